"""The baseline users start from: a FastAPI app calling sentence-transformers ``encode()`` once per request.

    python -m bench.naive_app --model-id DIR [--rerank-model-id DIR] --port P

Same request shapes as TEI (``/embed`` {"inputs": str | [str]}, ``/rerank`` {"query", "texts"}) so the
load generator sends identical bodies. Deliberately naive: plain ``def`` handlers (FastAPI's thread pool),
no batching across requests.
"""
from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class EmbedReq(BaseModel):
    inputs: str | list[str]
    normalize: bool = True


class RerankReq(BaseModel):
    query: str
    texts: list[str]


def build(model_id: str, rerank_model_id: str | None) -> FastAPI:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_id, device="cpu")
    ce = None
    if rerank_model_id:
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(rerank_model_id, device="cpu", num_labels=1)
    app = FastAPI()

    @app.get("/health")
    def health():
        return {}

    @app.post("/embed")
    def embed(req: EmbedReq):
        texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        return model.encode(texts, normalize_embeddings=req.normalize).tolist()

    @app.post("/rerank")
    def rerank(req: RerankReq):
        if ce is None:
            return {"error": "no rerank model"}
        scores = ce.predict([(req.query, t) for t in req.texts])
        return sorted(({"index": i, "score": float(s)} for i, s in enumerate(scores)),
                      key=lambda r: -r["score"])

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--rerank-model-id")
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    uvicorn.run(build(a.model_id, a.rerank_model_id), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
