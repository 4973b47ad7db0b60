"""Query time: embed the question through LiteLLM, search pgvector, rerank the candidates through the gateway.

The seed's pattern for a RAG query path: the embedding goes through the LLM gateway (LiteLLM, the model name its
config gives the embedder), the nearest CANDIDATES passages come from PostgreSQL + pgvector in two stages (the
RESCORE nearest by Hamming distance over the passages' binary vectors, HNSW index made by ingest.py, then those
ordered by cosine distance over their float vectors: a binary index 32x smaller than float32, rescored), and the
reranker (a cross-encoder, sized on its own) orders those candidates
through the Gateway API route; the best KEEP are the answer's context. Standard library HTTP and psycopg2.

    python3 query.py "Which currency is used in Japan?" ["another question" ...]

Vectors are state: LiteLLM does not pass the embedder's `embedding-space` header on, so through it the query
searches the view `passages` that ingest.py points at the space it ingested. With EMBED_URL set the question is
embedded at the embedder's own address instead, and searched in the table of the space that answered,
`passages_<space>`: during a change of the model a query is never compared with vectors of the other space, and a
space with no table yet is an error rather than noise.

Environment:
  LITELLM_URL, LITELLM_KEY   the proxy's base URL and a key it accepts; EMBED_MODEL its name for the embedder
  EMBED_URL                  optional: embed at the embedder's Service (and search its space's table) instead
  RERANK_URL                 the reranker's base URL through the gateway (hostname and path prefix included)
  RERANK_HOST                optional Host header, when RERANK_URL names the gateway's own Service instead
                             of a DNS name that resolves to it
  CANDIDATES (50), KEEP (5), RESCORE (4 x CANDIDATES: binary candidates rescored with float vectors),
  EF_SEARCH (100: pgvector's HNSW search list; raised to RESCORE when smaller: an index scan returns no more)
  PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE
One JSON line per query: the candidates (ids, nearest first), the kept ids (best first) with their rerank
scores, and each stage's latency in milliseconds.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

import psycopg2

EMBED_URL = os.environ.get("EMBED_URL", "").rstrip("/")
LITELLM_URL = os.environ.get("LITELLM_URL", "").rstrip("/")
LITELLM_KEY = os.environ.get("LITELLM_KEY", "")
EMBED_MODEL = os.environ.get("EMBED_MODEL", "")
RERANK_URL = os.environ["RERANK_URL"].rstrip("/")
RERANK_HOST = os.environ.get("RERANK_HOST", "")
CANDIDATES = int(os.environ.get("CANDIDATES", "50"))
KEEP = int(os.environ.get("KEEP", "5"))
EF_SEARCH = int(os.environ.get("EF_SEARCH", "100"))
RESCORE = int(os.environ.get("RESCORE", str(4 * CANDIDATES)))


def post(url: str, body: dict, headers: dict) -> object:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"query: {url} answered {e.code}: {e.read().decode(errors='replace')[:500]}")


def embed_query(text: str) -> tuple[list[float], str]:
    """The question's vector and the table to search: at the embedder (EMBED_URL), its space's table; else
    OpenAI's embeddings API on LiteLLM, which forwards to the embedder's /v1/embeddings, and the view."""
    if EMBED_URL:
        req = urllib.request.Request(EMBED_URL + "/embed", data=json.dumps({"inputs": [text]}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                space = r.headers.get("embedding-space") or ""
                return json.load(r)[0], (f"passages_{space}" if space.isalnum() else "passages")
        except urllib.error.HTTPError as e:
            sys.exit(f"query: {EMBED_URL} answered {e.code}: {e.read().decode(errors='replace')[:500]}")
    doc = post(LITELLM_URL + "/v1/embeddings", {"model": EMBED_MODEL, "input": [text]},
               {"Authorization": f"Bearer {LITELLM_KEY}"} if LITELLM_KEY else {})
    return doc["data"][0]["embedding"], "passages"


def search(cur, vector: list[float], table: str = "passages") -> list[tuple[str, str]]:
    """The RESCORE nearest passages by Hamming distance between sign bits (the server's `ubinary` form of the same
    vector: a sign is the same whoever takes it), then the CANDIDATES nearest of those by cosine distance."""
    bits = "".join("1" if x > 0 else "0" for x in vector)
    bits += "0" * (-len(bits) % 8)  # packed to whole bytes, as the server packs them
    cur.execute(f"SELECT id, body FROM (SELECT id, body, embedding FROM {table} ORDER BY bits <~> %s::bit({len(bits)}) "
                "LIMIT %s) AS binary_candidates ORDER BY embedding <=> %s::vector LIMIT %s",
                (bits, RESCORE, json.dumps(vector), CANDIDATES))
    return cur.fetchall()


def rerank(query: str, bodies: list[str]) -> list[dict]:
    """TEI's /rerank: [{index, score}] best first. The reranker's maxClientBatchSize must admit CANDIDATES."""
    return post(RERANK_URL + "/rerank", {"query": query, "texts": bodies},
                {"Host": RERANK_HOST} if RERANK_HOST else {})


def main(queries: list[str]) -> None:
    conn = psycopg2.connect("")
    cur = conn.cursor()
    cur.execute(f"SET hnsw.ef_search = {min(1000, max(EF_SEARCH, CANDIDATES, RESCORE))}")
    for q in queries:
        t0 = time.perf_counter()
        vector, table = embed_query(q)
        t1 = time.perf_counter()
        found = search(cur, vector, table)
        t2 = time.perf_counter()
        ranked = rerank(q, [body for _, body in found])
        t3 = time.perf_counter()
        kept = ranked[:KEEP]
        print(json.dumps({
            "query": q, "table": table, "candidates": [i for i, _ in found],
            "kept": [found[r["index"]][0] for r in kept], "scores": [r["score"] for r in kept],
            "latency_ms": {"embed_via_litellm": round((t1 - t0) * 1e3, 2), "vector_search": round((t2 - t1) * 1e3, 2),
                           "rerank_via_gateway": round((t3 - t2) * 1e3, 2), "total": round((t3 - t0) * 1e3, 2)},
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["Which currency is used in Japan?"])
