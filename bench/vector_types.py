"""Retrieval quality of int8 and binary vectors against float32 (issue 56).

Two sets, one embedops server (all-MiniLM-L6-v2, ONNX Runtime) through Cohere's `/v2/embed` with
`embedding_types: [float, int8, ubinary]` (one computation):

- **labelled**: the query-time example's corpus (examples/query-time/corpus.jsonl: 200 passages, four facts about
  each of 50 countries) with one labelled question per passage (its capital, currency, language, continent, asked
  in other words than the passage's): recall@10, nDCG@10 and recall@1;
- **agreement with float32**: 1,200 English sentences of Python's own documentation (the standard library's
  `pydoc_data`, so nothing is downloaded), the first 200 as queries against the other 1,000: how much of float32's
  top 10 each type finds (overlap@10), where there are many near neighbours to confuse.

Retrieval, exact, as an index compares the stored values:

- ``float32``: cosine over the float vectors (the reference);
- ``int8``: the dot product of the int8 vectors as they are (the server's one scale for the space);
- ``int8, ranges per dimension``: sentence-transformers' `quantize_embeddings` scheme (each dimension mapped from
  its own min..max over calibration vectors, here the 1,200 sentences' own) compared the same way: why the server
  does not use it;
- ``binary``: Hamming distance over the packed sign bits; ``binary + rescoring``: the binary top 100, reordered by
  the float query . float passage (the float vectors kept beside the index, as pgvector's `bit` column with a
  `halfvec` one);

and bytes per vector, and what the server adds to an answer to pack it.

    python -m bench.vector_types [--rescore 100]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "query-time" / "corpus.jsonl"
ASK = {"capital": "What is the capital city of {}?", "currency": "Which money do people use in {}?",
       "language": "What language do people speak in {}?", "continent": "On which continent is {}?"}
TYPES = ["float", "int8", "ubinary"]


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


def python_docs_sentences(n: int = 1200) -> list[str]:
    """Prose sentences of the standard library's pydoc topics (no code, 30-300 characters), in a fixed order."""
    import pydoc_data.topics as topics

    out: dict[str, None] = {}
    for key in sorted(topics.topics):
        for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", topics.topics[key])):
            if 30 <= len(s) <= 300 and s[0].isupper() and not re.search(r"[{}<>=_]|\.\.\.|::|\(\)", s):
                out[s] = None
    return list(out)[:n]


def embed(url: str, texts: list[str]) -> dict[str, np.ndarray]:
    import httpx

    got: dict[str, list] = {t: [] for t in TYPES}
    for i in range(0, len(texts), 32):
        r = httpx.post(url + "/v2/embed", json={"texts": texts[i:i + 32], "embedding_types": TYPES}, timeout=120)
        r.raise_for_status()
        for t in TYPES:
            got[t] += r.json()["embeddings"][t]
    return {"float": np.array(got["float"], dtype=np.float32), "int8": np.array(got["int8"], dtype=np.int32),
            "bits": np.array(got["ubinary"], dtype=np.uint8)}


def hamming(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """[nq, nd] Hamming distances between packed bit rows."""
    return np.unpackbits(q[:, None, :] ^ d[None, :, :], axis=-1).sum(-1)


def per_dimension_int8(v: np.ndarray, calibration: np.ndarray) -> np.ndarray:
    """sentence-transformers' int8: each dimension from its calibration min..max to -128..127."""
    lo, hi = calibration.min(0), calibration.max(0)
    return (np.clip(np.floor((v - lo) / ((hi - lo) / 255)), 0, 255) - 128).astype(np.int32)


def rankings(q: dict, d: dict, rescore: int, calibration: np.ndarray) -> dict[str, np.ndarray]:
    by = lambda scores: np.argsort(-scores, axis=1, kind="stable")  # noqa: E731
    bits = np.argsort(hamming(q["bits"], d["bits"]), axis=1, kind="stable")
    k = min(rescore, bits.shape[1])
    return {
        "float32 (cosine)": by(q["float"] @ d["float"].T),
        "int8 (dot product of the int8 values)": by(q["int8"] @ d["int8"].T),
        "int8, ranges per dimension (sentence-transformers')": by(
            per_dimension_int8(q["float"], calibration) @ per_dimension_int8(d["float"], calibration).T),
        "binary (Hamming)": bits,
        f"binary top {k}, rescored with float": np.array(
            [c[np.argsort(-(d["float"][c] @ qv), kind="stable")] for c, qv in zip(bits[:, :k], q["float"])]),
    }


def metrics(ranked: np.ndarray, relevant: list[int], k: int = 10) -> tuple[float, float]:
    recall, ndcg = 0.0, 0.0
    for row, rel in zip(ranked, relevant):
        top = list(row[:k])
        if rel in top:
            recall += 1
            ndcg += 1 / math.log2(top.index(rel) + 2)
    return recall / len(relevant), ndcg / len(relevant)


def overlap(ranked: np.ndarray, reference: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(ranked, reference)]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vector_types", description=__doc__.split("\n\n")[0])
    p.add_argument("--rescore", type=int, default=100, help="binary candidates reordered by float vectors")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-vector-types"))
    args = p.parse_args(argv)
    import httpx

    from bench.models import minilm_onnx_dir
    from bench.targets import embedops_target

    passages, questions, relevant = labelled()
    sentences = python_docs_sentences()
    t = embedops_target(minilm_onnx_dir(), "onnxruntime", log_dir=args.log_dir, name="embedops-onnx",
                        extra_args=["--pooling", "mean"])
    t.server.start()
    try:
        scale = httpx.get(t.server.url + "/info", timeout=30).json()["int8"]["scale"]
        dv, qv, sv = embed(t.server.url, passages), embed(t.server.url, questions), embed(t.server.url, sentences)
    finally:
        t.server.stop()
    split = lambda e, a, b: {k: v[a:b] for k, v in e.items()}  # noqa: E731
    sq, sd = split(sv, 0, 200), split(sv, 200, len(sentences))
    labelled_ranks = rankings(qv, dv, args.rescore, sv["float"])
    docs_ranks = rankings(sq, sd, args.rescore, sv["float"])
    reference = docs_ranks["float32 (cosine)"]
    dims = dv["float"].shape[1]
    size = {"float32": dims * 4, "int8": dims, "binary": dv["bits"].shape[1]}
    print(f"all-MiniLM-L6-v2 ({dims} dims), int8 scale {scale}; labelled: {len(passages)} passages, {len(questions)} "
          f"questions; agreement: {len(sq['float'])} queries against {len(sd['float'])} Python documentation "
          "sentences\n")
    print("| retrieval | recall@10 | nDCG@10 | recall@1 | overlap@10 with float32 (Python docs) | bytes per vector |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, ranked in labelled_ranks.items():
        r10, n10 = metrics(ranked, relevant)
        r1, _ = metrics(ranked, relevant, 1)
        kind = "float32" if name.startswith("float") else "int8" if name.startswith("int8") else "binary"
        print(f"| {name} | {r10:.3f} | {n10:.3f} | {r1:.3f} | {overlap(docs_ranks[name], reference):.3f} | "
              f"{size[kind]} |")
    print(f"\nwhat the server adds to an answer, one vector / 32: int8 {packing_us(1, 'int8'):.1f} / "
          f"{packing_us(32, 'int8'):.1f} us, binary {packing_us(1, 'binary'):.1f} / {packing_us(32, 'binary'):.1f} us")
    return 0


def packing_us(rows: int, kind: str, rounds: int = 5000) -> float:
    import time

    from embedops_server.core import quantize

    v = np.random.default_rng(0).standard_normal((rows, 384)).astype(np.float32)
    t = time.perf_counter()
    for _ in range(rounds):
        quantize.as_type(v, kind, 0.27)
    return (time.perf_counter() - t) / rounds * 1e6


if __name__ == "__main__":
    sys.exit(main())
