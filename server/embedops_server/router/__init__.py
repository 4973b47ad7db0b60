"""HTTP layer: FastAPI app, TEI/OpenAI/Cohere schemas, errors, auth, metrics. Never touches tensors."""
