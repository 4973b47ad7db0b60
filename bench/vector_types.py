"""Retrieval quality of binary vectors against float32, on labelled questions (issue 56).

The query-time example's corpus (examples/query-time/corpus.jsonl: 200 passages, four facts about each of 50
countries) with one labelled question per passage (its capital, currency, language, continent, asked in other
words than the passage's). One embedops server (all-MiniLM-L6-v2, ONNX Runtime) embeds passages and questions
through Cohere's `/v2/embed` with `embedding_types: [float, ubinary]` (one computation). Retrieval, exact:

- ``float32``: cosine over the float vectors (the reference);
- ``binary``: Hamming distance over the packed sign bits of passages and question;
- ``binary + rescoring``: the binary top 100, reordered by the float question · float passage (the float vectors
  kept beside the index, as pgvector's `bit` column with a `halfvec` one);

recall@10 and nDCG@10 (one relevant passage per question), and bytes per vector.

    python -m bench.vector_types [--rescore 100]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "query-time" / "corpus.jsonl"
ASK = {"capital": "What is the capital city of {}?", "currency": "Which money do people use in {}?",
       "language": "What language do people speak in {}?", "continent": "On which continent is {}?"}


def labelled() -> tuple[list[str], list[str], list[int]]:
    """(passages, questions, the index of each question's passage)."""
    docs = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    countries = {}
    for d in docs:
        if d["id"].endswith("-capital"):
            countries[d["id"][: -len("-capital")]] = d["text"].removeprefix("The capital of ").split(" is ")[0]
    questions, relevant = [], []
    for i, d in enumerate(docs):
        key, _, attr = d["id"].rpartition("-")
        questions.append(ASK[attr].format(countries[key]))
        relevant.append(i)
    return [d["text"] for d in docs], questions, relevant


def embed(url: str, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    import httpx

    floats, bits = [], []
    for i in range(0, len(texts), 32):
        r = httpx.post(url + "/v2/embed", json={"texts": texts[i:i + 32], "embedding_types": ["float", "ubinary"]},
                       timeout=120)
        r.raise_for_status()
        e = r.json()["embeddings"]
        floats += e["float"]
        bits += e["ubinary"]
    return np.array(floats, dtype=np.float32), np.array(bits, dtype=np.uint8)


def hamming(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """[nq, nd] Hamming distances between packed bit rows."""
    return np.unpackbits(q[:, None, :] ^ d[None, :, :], axis=-1).sum(-1)


def metrics(ranked: np.ndarray, relevant: list[int], k: int = 10) -> tuple[float, float]:
    recall, ndcg = 0.0, 0.0
    for row, rel in zip(ranked, relevant):
        top = list(row[:k])
        if rel in top:
            recall += 1
            ndcg += 1 / math.log2(top.index(rel) + 2)
    return recall / len(relevant), ndcg / len(relevant)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vector_types", description=__doc__.split("\n\n")[0])
    p.add_argument("--rescore", type=int, default=100, help="binary candidates reordered by float vectors")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-vector-types"))
    args = p.parse_args(argv)
    from bench.models import minilm_onnx_dir
    from bench.targets import embedops_target

    passages, questions, relevant = labelled()
    t = embedops_target(minilm_onnx_dir(), "onnxruntime", log_dir=args.log_dir, name="embedops-onnx",
                        extra_args=["--pooling", "mean"])
    t.server.start()
    try:
        dv, db = embed(t.server.url, passages)
        qv, qb = embed(t.server.url, questions)
    finally:
        t.server.stop()
    by_float = np.argsort(-(qv @ dv.T), axis=1, kind="stable")
    by_bits = np.argsort(hamming(qb, db), axis=1, kind="stable")
    k = min(args.rescore, len(passages))
    rescored = np.array([cand[np.argsort(-(dv[cand] @ q), kind="stable")] for cand, q in zip(by_bits[:, :k], qv)])
    rows = [("float32", by_float, dv.shape[1] * 4), ("binary (Hamming)", by_bits, db.shape[1]),
            (f"binary top {k}, rescored with float", rescored, db.shape[1])]
    print(f"{len(passages)} passages, {len(questions)} labelled questions, all-MiniLM-L6-v2 ({dv.shape[1]} dims)\n")
    print("| retrieval | recall@10 | nDCG@10 | recall@1 | bytes per vector (index) |")
    print("| --- | --- | --- | --- | --- |")
    for name, ranked, size in rows:
        r10, n10 = metrics(ranked, relevant)
        r1, _ = metrics(ranked, relevant, 1)
        print(f"| {name} | {r10:.3f} | {n10:.3f} | {r1:.3f} | {size} |")
    print(f"\nwhat the server adds to an answer: {packing_us(1):.1f} us to pack one vector, {packing_us(32):.1f} us for "
          "32 (binary)")
    return 0


def packing_us(rows: int, rounds: int = 5000) -> float:
    import time

    from embedops_server.core import quantize

    v = np.random.default_rng(0).standard_normal((rows, 384)).astype(np.float32)
    t = time.perf_counter()
    for _ in range(rounds):
        quantize.binary(v)
    return (time.perf_counter() - t) / rounds * 1e6


if __name__ == "__main__":
    sys.exit(main())
