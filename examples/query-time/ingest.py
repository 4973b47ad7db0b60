"""Ingestion: embed a corpus through the embedder's Service and store it in PostgreSQL + pgvector.

Runs as the Kubernetes Job in ingest.yaml (any image with Python 3 and psycopg2). Standard library HTTP only,
so the same script runs anywhere. Idempotent: a retried Job (backoffLimit) upserts the same rows.

Vectors are state: each answer's `embedding-space` header names the space its vectors belong to, and the rows go
into a table of that space, `passages_<space>`; a first ingestion also points the view `passages` at it (what
query.py searches when it embeds through LiteLLM, which does not pass the header on). Run as an EmbeddingService's
reindex Job (spec.migration.reindex), it embeds through the new space's own address (EMBEDOPS_SPACE_URL) into that
space's table while the old one keeps serving queries, and leaves the view alone.

Environment:
  EMBED_URL   the embedder's base URL inside the cluster, e.g. http://embedder.rag.svc.cluster.local:80
              (EMBEDOPS_SPACE_URL, which the operator gives a reindex Job, comes first)
  API_KEY     optional; sent as a Bearer token when the service has apiKeySecretRef
  CORPUS      JSON lines of {"id": ..., "text": ...} (default /app/corpus.jsonl)
  BATCH       inputs per /embed request (default 32: the server's default maxClientBatchSize)
  PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE   libpq's own variables
Prints one JSON line: rows stored, dimension, seconds spent embedding and in total.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

import psycopg2

EMBED_URL = (os.environ.get("EMBEDOPS_SPACE_URL") or os.environ["EMBED_URL"]).rstrip("/")
REINDEX = bool(os.environ.get("EMBEDOPS_SPACE"))  # run by the operator for a new space: the view is not ours
API_KEY = os.environ.get("API_KEY", "")
CORPUS = os.environ.get("CORPUS", "/app/corpus.jsonl")
BATCH = int(os.environ.get("BATCH", "32"))


def embed(texts: list[str]) -> tuple[list[list[float]], list[str], str | None]:
    """POST /v2/embed (Cohere's route): one vector per text, L2-normalized, so cosine distance is what pgvector
    ranks by, and from the same computation its binary form (the sign bits, 32x smaller: query.py's first stage),
    as a bit string; and the embedding space they belong to. 429 (the server's backpressure) and 503 (a pod not
    ready yet) are retried with backoff; other errors stop the Job with the server's message."""
    body = json.dumps({"texts": texts, "embedding_types": ["float", "ubinary"], "truncate": "END"}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {API_KEY}"} if API_KEY else {})}
    for attempt in range(8):
        req = urllib.request.Request(EMBED_URL + "/v2/embed", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.load(r)["embeddings"]
                bits = ["".join(f"{b:08b}" for b in row) for row in got["ubinary"]]
                return got["float"], bits, r.headers.get("embedding-space")
        except urllib.error.HTTPError as e:
            if e.code not in (429, 503):
                sys.exit(f"ingest: /v2/embed answered {e.code}: {e.read().decode(errors='replace')[:500]}")
        except (urllib.error.URLError, OSError) as e:  # the Service has no endpoint yet, a reset connection
            print(f"ingest: /v2/embed not reachable ({e}); retrying", file=sys.stderr)
        time.sleep(min(2 ** attempt * 0.25, 10))
    sys.exit("ingest: /v2/embed kept refusing (429/503) after 8 attempts")


def connect():
    """libpq's environment; waits for the database to accept connections (it may start with the Job)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            return psycopg2.connect("")
        except psycopg2.OperationalError as e:
            if time.monotonic() > deadline:
                raise
            print(f"ingest: database not ready ({str(e).strip()}); retrying", file=sys.stderr)
            time.sleep(2)


def main() -> None:
    t0 = time.monotonic()
    with open(CORPUS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    conn = connect()
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
    embed_seconds, dim, space, table = 0.0, None, None, None
    for i in range(0, len(rows), BATCH):
        chunk = rows[i:i + BATCH]
        t = time.monotonic()
        vectors, bits, answered = embed([r["text"] for r in chunk])
        embed_seconds += time.monotonic() - t
        if dim is None:
            dim, space = len(vectors[0]), answered
            # the space's own table (its name: hex digits only); a server without the header: one table
            table = f"passages_{space}" if space and space.isalnum() else "passages"
            cur.execute(f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY, body text NOT NULL, "
                        f"embedding vector({dim}) NOT NULL)")
            # the binary form (a table of an earlier version of this script gets the column)
            cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS bits bit({len(bits[0])})")
        elif answered != space:  # the service's space changed under this Job: its rows would mix two spaces
            sys.exit(f"ingest: the embedding space changed from {space} to {answered} during ingestion; run again")
        cur.executemany(f"INSERT INTO {table} (id, body, embedding, bits) VALUES (%s, %s, %s::vector, %s::bit(%s)) "
                        "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, embedding = EXCLUDED.embedding, "
                        "bits = EXCLUDED.bits",
                        [(r["id"], r["text"], json.dumps(v), b, len(b)) for r, v, b in zip(chunk, vectors, bits)])
    # HNSW on Hamming distance over the bits: query.py's first stage (ORDER BY bits <~> ...), whose candidates
    # it orders by cosine distance over the float vectors (read for those rows only)
    cur.execute(f"CREATE INDEX IF NOT EXISTS {table}_bits_hnsw ON {table} USING hnsw (bits bit_hamming_ops)")
    cur.execute(f"ANALYZE {table}")
    cur.execute("SELECT relkind FROM pg_class WHERE relname = 'passages'")
    kind = (cur.fetchone() or [None])[0]
    if table != "passages" and not REINDEX and kind in (None, "v"):  # a table of that name (an older run) stays
        cur.execute(f"CREATE OR REPLACE VIEW passages AS SELECT id, body, embedding, bits FROM {table}")
    cur.execute(f"SELECT count(*) FROM {table}")
    stored = cur.fetchone()[0]
    print(json.dumps({"rows": stored, "corpus": len(rows), "dimension": dim, "space": space, "table": table,
                      "embed_seconds": round(embed_seconds, 3), "seconds": round(time.monotonic() - t0, 3)}))


if __name__ == "__main__":
    main()
