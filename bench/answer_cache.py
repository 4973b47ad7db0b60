"""The answer cache (--answer-cache-bytes, issue 56) against no cache, side by side on one machine.

Two servers of the same model (all-MiniLM-L6-v2, ONNX Runtime), one with the cache, started together; each round
runs every workload on one, then the other (the order alternates per round), with texts the round made fresh, so
the cache starts every workload empty and what it gains is what that workload's repeats give:

- ``reindex``: a corpus of chunks (~128 tokens) of which 30% repeat an earlier one (boilerplate, duplicates),
  shuffled, sent once in requests of 32 by 4 clients: texts/s;
- ``zipf``: single-text queries (~16 tokens) drawn from 5,000 by a Zipf law (s = 1.1), 4 clients: p50, p99,
  queries/s and the hit ratio (the server's own counters);
- ``unique``: what no cache helps: unique queries (4 clients) and unique chunks in requests of 32 (4 clients): the
  cost of looking up and keeping every answer.

Also the cache's own cost per input, in this process (a lookup that misses and the insert of a 384-float answer):
the part of a request the `unique` rows cannot resolve on a shared machine.

    python -m bench.answer_cache [--rounds 3] [--duration 15] [--chunks 1500] [--cache-mib 256]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from bench.loadgen import Request, percentile, run_load, summarize

CHUNK_TOKENS, QUERY_TOKENS, BATCH, CLIENTS = 128, 16, 32, 4
DUPLICATES = 0.30
ZIPF_S, ZIPF_POOL = 1.1, 5000


def reindex_corpus(gen, chunks: int, rng: random.Random) -> list[str]:
    unique = gen.texts(int(chunks * (1 - DUPLICATES)), CHUNK_TOKENS)
    corpus = unique + [rng.choice(unique) for _ in range(chunks - len(unique))]
    rng.shuffle(corpus)
    return corpus


def zipf_stream(gen, n: int, rng: random.Random) -> list[str]:
    pool = gen.texts(ZIPF_POOL, QUERY_TOKENS)
    weights = [1 / (k + 1) ** ZIPF_S for k in range(len(pool))]
    return rng.choices(pool, weights=weights, k=n)


def counters(url: str) -> tuple[int, int]:
    with urllib.request.urlopen(url + "/info", timeout=10) as r:
        c = json.loads(r.read()).get("answer_cache") or {}
    return c.get("hits", 0), c.get("misses", 0)


async def workload(kind: str, url: str, texts: list[str], duration: float) -> dict:
    if kind in ("reindex", "unique-chunks"):
        reqs = [Request({"inputs": texts[i:i + BATCH]}, len(texts[i:i + BATCH]), 0)
                for i in range(0, len(texts), BATCH)]
        samples, wall = await run_load(url + "/embed", reqs, concurrency=CLIENTS, max_requests=len(reqs),
                                       duration_s=600, drain_s=120, request_timeout_s=120)
    else:
        reqs = [Request({"inputs": t}, 1, 0) for t in texts]
        samples, wall = await run_load(url + "/embed", reqs, concurrency=CLIENTS, max_requests=len(reqs),
                                       duration_s=duration, drain_s=60)
    st = summarize(samples, wall)
    good = [s.latency * 1000 for s in samples if s.ok]
    return {"texts_s": st.texts_s, "p50_ms": percentile(good, 50), "p99_ms": percentile(good, 99), "ok": st.ok,
            "errors": st.errors}


def cache_cost_us(rounds: int = 20000) -> tuple[float, float]:
    """Microseconds per input of a lookup that misses and of keeping its answer (a 384-float vector)."""
    import numpy as np

    from embedops_server.core.cache import AnswerCache

    cache = AnswerCache(256 << 20)
    texts = [f"query number {i} about something" for i in range(rounds)]
    row = np.ones(384, dtype=np.float32)
    t = time.perf_counter()
    for i in range(0, rounds, BATCH):
        got = cache.lookup(texts[i:i + BATCH], True, "right")
        for j in got.missing:
            cache.put(got.keys[j], row)
    per_input = (time.perf_counter() - t) / rounds * 1e6
    t = time.perf_counter()
    for i in range(0, rounds, BATCH):
        cache.lookup(texts[i:i + BATCH], True, "right")
    return per_input, (time.perf_counter() - t) / rounds * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.answer_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of each query workload")
    p.add_argument("--chunks", type=int, default=1500, help="chunks of the re-index (and of unique-chunks)")
    p.add_argument("--cache-mib", type=int, default=256)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-answer-cache"))
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from bench.models import minilm_onnx_dir
    from bench.targets import embedops_target
    from bench.textgen import TextGen, load_tokenizer

    model = minilm_onnx_dir()
    targets = {"off": embedops_target(model, "onnxruntime", log_dir=args.log_dir, name="embedops-onnx",
                                      extra_args=["--pooling", "mean"]),
               "on": embedops_target(model, "onnxruntime", log_dir=args.log_dir, name="embedops-onnx-cache",
                                     extra_args=["--pooling", "mean", "--answer-cache-bytes",
                                                 str(args.cache_mib << 20)])}
    rows: list[dict] = []
    try:
        for t in targets.values():
            t.server.start()
        for name, t in targets.items():  # a fresh server's first seconds are not the steady state
            asyncio.run(workload("unique", t.server.url, [f"warm-up {i}" for i in range(200)], 5))
        for r in range(args.rounds):
            gen = TextGen(load_tokenizer(model), seed=1000 + r)
            rng = random.Random(r)
            texts = {"reindex": reindex_corpus(gen, args.chunks, rng),
                     "zipf": zipf_stream(gen, 20000, rng),
                     "unique": gen.texts(20000, QUERY_TOKENS),
                     "unique-chunks": gen.texts(args.chunks, CHUNK_TOKENS)}
            order = list(targets) if r % 2 == 0 else list(targets)[::-1]
            for kind, batch in texts.items():
                for name in order:
                    url = targets[name].server.url
                    h0, m0 = counters(url)
                    res = asyncio.run(workload(kind, url, batch, args.duration))
                    h1, m1 = counters(url)
                    row = {"round": r, "workload": kind, "cache": name, **res,
                           "hit_ratio": (h1 - h0) / max(1, (h1 - h0) + (m1 - m0)) if name == "on" else None}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    finally:
        for t in targets.values():
            t.server.stop()
    miss_put, hit = cache_cost_us()
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "time": time.time(), "rows": rows,
                                         "cache_us_per_input": {"miss_and_put": miss_put, "hit": hit}}, indent=1))
    report(rows, miss_put, hit)
    return 0


def _median(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def report(rows: list[dict], miss_put: float, hit: float) -> None:
    print("| workload | texts/s off | texts/s on | on / off | p50 ms off | p50 ms on | p99 ms off | p99 ms on "
          "| hit ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in dict.fromkeys(r["workload"] for r in rows):
        def med(cache, key):
            return _median([r[key] for r in rows if r["workload"] == kind and r["cache"] == cache])
        # the ratio per round (the two ran back to back), then its median: less of the machine's drift
        ratios = [on["texts_s"] / off["texts_s"] for on in rows for off in rows
                  if on["workload"] == off["workload"] == kind and on["round"] == off["round"]
                  and on["cache"] == "on" and off["cache"] == "off" and off["texts_s"]]
        print(f"| {kind} | {med('off', 'texts_s'):.0f} | {med('on', 'texts_s'):.0f} | {_median(ratios):.3f} "
              f"| {med('off', 'p50_ms'):.1f} | {med('on', 'p50_ms'):.1f} | {med('off', 'p99_ms'):.1f} "
              f"| {med('on', 'p99_ms'):.1f} | {med('on', 'hit_ratio'):.2f} |")
    print(f"\nthe cache's own cost, per input (this process): a miss and its insert {miss_put:.2f} us, a hit "
          f"{hit:.2f} us")


if __name__ == "__main__":
    sys.exit(main())
