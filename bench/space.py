"""Which server settings change the embedding space: the same texts through real servers over HTTP, side by side.

An index holds vectors of one space, and a query vector from another retrieves noise. The fingerprint that names a
space (embedops_server/core/space.py) must change with whatever moves the vectors beyond noise, and only with
that: a fingerprint that changes with noise splits one space in two (a GPU query service and a CPU ingestion service
of the same model could not share an index); one that misses a real change mixes two spaces behind one name.

Each variant is a real `embedops-server` (its own process, loopback port) embedding the same texts (the query-time
corpus and longer generated passages); the reference is float32 on ONNX Runtime. For each variant: the cosine of
its vector with the reference's, per text (min, mean), and, using every text as a query over all the others, how
many of the reference's 10 nearest neighbours it finds among its own (overlap@10; 1.00 = the same retrieval) and
how often a query vector of the variant finds the reference's top hit in a reference-space index (mixed top-1).

    python -m bench.space                 # all-MiniLM-L6-v2, every variant below, a table on stdout
    python -m bench.space --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

import numpy as np

from .procs import Server, free_port

REPO = Path(__file__).resolve().parent.parent
# name -> (server flags, what it changes)
VARIANTS = {
    "float32-ort": (["--backend", "onnxruntime"], "the reference: float32 on ONNX Runtime"),
    "float32-torch": (["--backend", "torch"], "another backend, same weights and dtype"),
    "bfloat16-torch": (["--backend", "torch", "--dtype", "bfloat16"], "bfloat16 weights and activations"),
    "float16-torch": (["--backend", "torch", "--dtype", "float16"], "float16 (what GPUs serve)"),
    "int8-ort": (["--backend", "onnxruntime", "--quantize", "int8"], "int8 dynamic quantization"),
    "pooling-cls": (["--backend", "onnxruntime", "--pooling", "cls"], "control: another pooling"),
    "prompt": (["--backend", "onnxruntime", "--default-prompt", "query: "], "control: a prompt prefix"),
}


LONG = 56  # passages of 6-12 corpus sentences (~60-150 tokens) beside the 200 short ones


def texts() -> list[str]:
    import random

    corpus = [json.loads(line)["text"] for line in (REPO / "examples/query-time/corpus.jsonl").read_text().splitlines()]
    rng = random.Random(7)
    return corpus + [" ".join(rng.sample(corpus, rng.randint(6, 12))) for _ in range(LONG)]


def embed(url: str, inputs: list[str]) -> tuple[np.ndarray, str | None]:
    out, space = [], None
    for i in range(0, len(inputs), 32):
        req = urllib.request.Request(url + "/embed", data=json.dumps({"inputs": inputs[i:i + 32]}).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out += json.loads(r.read())
            space = r.headers.get("embedding-space")
    return np.asarray(out, np.float64), space


def neighbours(vectors: np.ndarray, queries: np.ndarray, k: int = 10) -> np.ndarray:
    sims = queries @ vectors.T
    np.fill_diagonal(sims, -np.inf)  # a text is not its own neighbour
    return np.argsort(-sims, axis=1)[:, :k]


def compare(ref: np.ndarray, other: np.ndarray) -> dict:
    unit = lambda v: v / np.linalg.norm(v, axis=1, keepdims=True)  # noqa: E731
    ref, other = unit(ref), unit(other)
    cos = np.sum(ref * other, axis=1)
    nn_ref, nn_other = neighbours(ref, ref), neighbours(other, other)
    overlap = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(nn_ref, nn_other)])
    mixed = np.mean(neighbours(ref, other, 1)[:, 0] == nn_ref[:, 0])  # variant's queries on the reference's index
    return {"cos_min": float(cos.min()), "cos_mean": float(cos.mean()), "overlap10": float(overlap),
            "mixed_top1": float(mixed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.space", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-id", help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    if args.model_id is None:
        from localcluster.models import minilm_dir

        args.model_id = str(minilm_dir())
    inputs = texts()
    results, spaces, ref = {}, {}, None
    for name in args.variants.split(","):
        flags, _ = VARIANTS[name]
        port = free_port()
        argv_ = [sys.executable, "-m", "embedops_server.cli", "--model-id", args.model_id, "--port", str(port),
                 "--hostname", "127.0.0.1", "--num-threads", "2", *flags]
        with Server(name, argv_, port) as server:
            vectors, spaces[name] = embed(server.url, inputs)
        if ref is None:
            ref = vectors
        results[name] = compare(ref, vectors)
    print(f"{len(inputs)} texts ({len(inputs) - LONG} short, {LONG} passages of 6-12 of them), {args.model_id}")
    print(f"{'variant':<16} {'cos min':>9} {'cos mean':>9} {'overlap@10':>10} {'mixed top1':>10}  {'space':<16} what")
    for name, r in results.items():
        print(f"{name:<16} {r['cos_min']:>9.6f} {r['cos_mean']:>9.6f} {r['overlap10']:>10.3f} {r['mixed_top1']:>10.3f}"
              f"  {spaces[name] or '-':<16} {VARIANTS[name][1]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "spaces": spaces}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
