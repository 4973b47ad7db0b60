"""Scenario 6 (bge-m3 layout): the combined request against dense-only on the same texts, and FlagEmbedding inline.

    python -m bench.m3 [--hidden 384 --layers 6] [--backend onnx] [--requests 12] [--rounds 2]

No bge-m3 checkpoint is reachable here, so the model is a random XLM-RoBERTa in bge-m3's layout
(bench/m3_model.py; default MiniLM-sized: 384 hidden, 6 layers, so the heads weigh relatively more than on
bge-m3's 1024 x 24, a conservative ratio). Traffic: ingestion requests of 32 texts x 256 tokens, concurrency 2
(as scenario 3), rounds interleaved:
- dense: POST /embed (normalized);
- hybrid: POST /embed_hybrid with dense + sparse + ColBERT (JSON floats), and the same with base64;
- FlagEmbedding inline: BGEM3FlagModel.encode(dense + sparse + ColBERT) of the same batches in its own venv
  (bench/flagembedding.py), float32 on CPU, batch 32, the same thread count.
Prints a table (tokens/s, ratio to dense-only, response bytes per request) and writes bench/results/m3-*.json.
"""
from __future__ import annotations

import atexit
import shutil
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .loadgen import Request, run_load_sync, summarize
from .targets import embedops_target
from .textgen import TextGen, load_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
TEXTS, TOKENS = 32, 256


def log(*a) -> None:
    print(time.strftime("[%H:%M:%S]"), *a, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.m3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--requests", type=int, default=12, help="requests per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-flag", action="store_true", help="skip FlagEmbedding inline")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from bench.m3_model import build_m3_folder

    tmp = Path(tempfile.mkdtemp(prefix="bench-m3-"))
    atexit.register(shutil.rmtree, tmp, True)  # its model and exports: tens of MB a run, not kept
    model = build_m3_folder(tmp / "m3", hidden=args.hidden, layers=args.layers, max_positions=514)
    gen = TextGen(load_tokenizer(model), seed=1234)
    batches = [gen.texts(TEXTS, TOKENS) for _ in range(4)]
    ntok = [sum(gen.count(b)) for b in batches]
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    target = embedops_target(model, args.backend, log_dir=logs, name=f"embedops-{args.backend}",
                             extra_args=["--num-threads", str(args.threads), "--onnx-cache", str(tmp / "cache")])
    variants = {
        "dense (/embed)": ("/embed", lambda b: {"inputs": b}),
        "dense+sparse+colbert (/embed_hybrid)": ("/embed_hybrid", lambda b: {"inputs": b}),
        "dense+sparse+colbert, base64": ("/embed_hybrid", lambda b: {"inputs": b, "encoding_format": "base64"}),
    }
    rows: dict[str, list[float]] = {k: [] for k in variants}
    sizes: dict[str, int] = {}
    with target.server:  # __enter__ starts it (start() here too would leak a second server)
        for name, (path, body) in variants.items():  # warm-up + response size of one 32 x 256 request
            r = httpx.post(target.server.url + path, json=body(batches[0]), timeout=300)
            r.raise_for_status()
            sizes[name] = len(r.content)
        for rnd in range(args.rounds):
            order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
            for name in order:
                path, body = variants[name]
                reqs = [Request(body(b), len(b), n) for b, n in zip(batches, ntok)]
                samples, wall = run_load_sync(target.server.url + path, reqs, concurrency=2,
                                              max_requests=args.requests, duration_s=300, request_timeout_s=300)
                st = summarize(samples, wall)
                if st.errors:
                    raise RuntimeError(f"{name}: {st.errors} errors {st.error_kinds}")
                rows[name].append(st.tokens_s)
                log(f"round {rnd + 1} {name}: {st.tokens_s:.0f} tokens/s")
        rss = target.server.peak_rss_mb()
    flag = None
    if not args.no_flag:
        from .flagembedding import encode

        texts = [t for b in batches for t in b]
        res = encode(model, texts, max_length=512, batch_size=TEXTS, timing_rounds=args.rounds, threads=args.threads)
        flag = [sum(ntok) / s for s in res["seconds"]]
        log("FlagEmbedding inline:", ", ".join(f"{x:.0f}" for x in flag), "tokens/s")
    med = {k: statistics.median(v) for k, v in rows.items()}
    dense = med["dense (/embed)"]
    lines = ["| request (32 x 256 tokens, c=2) | tokens/s | vs dense-only | response bytes |",
             "| --- | --- | --- | --- |"]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.0f} | {v / dense:.2f} | {sizes[k]:,} |")
    if flag:
        f = statistics.median(flag)
        lines.append(f"| FlagEmbedding 1.4.2 inline, dense+sparse+colbert | {f:.0f} | {f / dense:.2f} | – |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out) / f"m3-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"args": vars(args), "tokens_s": rows, "flag_tokens_s": flag, "bytes": sizes,
                               "peak_rss_mb": rss, "table": table}, indent=1))
    log("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
