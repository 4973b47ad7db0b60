"""embedops batching server: TEI-compatible embeddings, rerank, sparse and classification over HTTP."""

__version__ = "0.1.0"
