"""An online query beside a saturating ingestion load, on one server: interactive and batch lanes.

For each target, in one run and side by side (targets alternate per round so a noisy machine hits all alike):

- ``alone``: the query client only: one ~16-token text every 20 ms (Poisson arrivals, at most 8 in flight);
- ``ingest``: the ingestion clients only: N clients in a closed loop, each sending /embed with 32 texts of
  ~200 tokens; a client answered 429 waits its Retry-After, as the OpenAI SDK does (16 clients x 32 texts is
  more than the batch lane admits by default: 0.75 x 512 inputs);
- ``mixed``: both at once.

Prints per target the query p50/p99 alone and beside ingestion, ingestion texts/s alone and beside the queries,
and the ratios the targets of issue 37 are about: query p99 mixed / alone (target <= 3) and ingestion mixed /
alone (target >= 0.9).

    python -m bench.lanes [--targets embedops,embedops+lanes=false,tei] [--clients 4,16] [--int8]
                          [--model minilm|568m] [--duration 20] [--rounds 1]

Targets: ``embedops`` (lanes on: the default), ``embedops+flag=value`` (server flags, e.g. ``+lanes=false``),
``tei`` (TEI 1.9.3's ONNX Runtime backend on the same graph; needs ``python -m bench.tei build``).
``--int8`` runs every target on the int8 graph (embedops ``--quantize int8``, ``tei+int8``).
``--model 568m``: a random XLM-R-large geometry model (bge-m3's size, bench/real_size.py), the seed's CPU
workload at its real size; its query and ingestion rates are scaled down (see SCALE).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.loadgen import Request, percentile, run_load, summarize

QUERY_TOKENS = 16
INGEST_TEXTS, INGEST_TOKENS = 32, 200
QUERY_RATE = 50.0  # queries/s: one every 20 ms
# 568M: a forward costs ~40x MiniLM's; the same clients would only measure a queue growing without bound
# (server flags: the operator's for the seed's CPU workload, docs/server.md "Memory": a 512-token limit, and a
# batch budget whose warm-up does not take minutes; TEI gets the same budget)
SCALE = {"minilm": dict(query_rate=QUERY_RATE, ingest_texts=INGEST_TEXTS, embedops=[], tei="", startup_s=180),
         "568m": dict(query_rate=2.0, ingest_texts=8, embedops=["--max-input-length", "512",
                                                               "--max-batch-tokens", "8192"],
                      tei="+max-batch-tokens=8192", startup_s=600)}


def model_folder(name: str) -> Path:
    if name == "568m":
        from bench.real_size import bge_m3

        return bge_m3()
    from bench.models import minilm_dir

    return minilm_dir()


def start(name: str, model_dir: Path, int8: bool, log_dir: Path, scale: dict):
    from bench.targets import embedops_target
    from bench.tei import tei_target

    if name.split("+")[0] == "tei":
        t = tei_target(name + ("+int8" if int8 else "") + scale["tei"], model_dir, log_dir=log_dir)
    else:
        extra = (["--quantize", "int8"] if int8 else []) + scale["embedops"]
        t = embedops_target(model_dir, "onnxruntime", log_dir=log_dir,
                            name="embedops-onnx" + name[len("embedops"):], extra_args=extra)
    t.server.startup_timeout_s = scale["startup_s"]
    return t


async def phase(kind: str, url: str, query: list[Request], ingest: list[Request], clients: int,
                duration: float, rate: float) -> dict:
    """Warm-ups first, one after the other, then the measured load at once: a query warm-up sent beside the
    ingestion would wait behind it in a FIFO server, and its measurement would begin after the ingestion ended."""
    if kind in ("alone", "mixed"):  # a fresh server's first seconds (new shapes, cold caches) are not the steady state
        await run_load(url, query, concurrency=8, rate=rate, duration_s=max(2.0, 100 / rate), drain_s=60)
    if kind in ("ingest", "mixed"):  # one request per client: the queue holds ingestion work when the phase starts
        await run_load(url, ingest, concurrency=clients, max_requests=clients, duration_s=600, drain_s=600,
                       request_timeout_s=600)
    jobs = {}
    if kind in ("alone", "mixed"):
        jobs["query"] = run_load(url, query, concurrency=8, rate=rate, duration_s=duration, drain_s=60)
    if kind in ("ingest", "mixed"):
        jobs["ingest"] = run_load(url, ingest, concurrency=clients, duration_s=duration, drain_s=120,
                                  request_timeout_s=120, honor_retry_after=True)
    results = await asyncio.gather(*jobs.values())
    out = {}
    for (name, (samples, wall)) in zip(jobs, results):
        st = summarize(samples, wall)
        good = [s.latency * 1000 for s in samples if s.ok]
        out[name] = {"p50": percentile(good, 50), "p99": percentile(good, 99), "texts_s": st.texts_s,
                     "ok": st.ok, "errors": st.errors, "error_kinds": st.error_kinds}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lanes", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="embedops,embedops+lanes=false,tei")
    p.add_argument("--clients", default="4,16", help="ingestion clients, comma-separated")
    p.add_argument("--int8", action="store_true")
    p.add_argument("--model", choices=sorted(SCALE), default="minilm")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-lanes"))
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args(argv)
    from bench.textgen import TextGen, load_tokenizer

    model_dir = model_folder(args.model)
    scale = SCALE[args.model]
    gen = TextGen(load_tokenizer(model_dir))
    query = [Request({"inputs": t}, 1, QUERY_TOKENS) for t in gen.texts(200, QUERY_TOKENS)]
    n = scale["ingest_texts"]
    ingest = [Request({"inputs": gen.texts(n, INGEST_TOKENS)}, n, n * INGEST_TOKENS) for _ in range(24)]
    clients = [int(c) for c in args.clients.split(",")]
    names = [t for t in args.targets.split(",") if t]
    rows: list[dict] = []
    started = {}
    try:
        for name in names:
            try:
                t = start(name, model_dir, args.int8, args.log_dir, scale)
                t.server.start()
                started[name] = t
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a line, not the end
                print(f"{name}: not run: {str(e).splitlines()[0][:300]}", file=sys.stderr)
        for r in range(args.rounds):
            order = list(started) if r % 2 == 0 else list(started)[::-1]
            for name in order:
                t = started[name]
                for c in clients:
                    for kind in ("alone", "ingest", "mixed"):
                        if kind == "alone" and c != clients[0]:
                            continue  # the query alone does not depend on the ingestion clients
                        cpu0, own0 = t.server.cpu_s(), time.process_time()
                        res = asyncio.run(phase(kind, t.embed_url, query, ingest, c, args.duration,
                                                scale["query_rate"]))
                        row = {"target": name, "clients": c, "phase": kind, "round": r, **{
                            f"{k}_{m}": v for k, d in res.items() for m, v in d.items()},
                            # CPU seconds of the server's process tree and of this load generator in the phase
                            "server_cpu_s": t.server.cpu_s() - cpu0, "client_cpu_s": time.process_time() - own0}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr)
    finally:
        for t in started.values():
            t.server.stop()
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "time": time.time(), "rows": rows}, indent=1))
    report(rows, clients, args)
    return 0


def _median(xs):
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else float("nan")


def report(rows: list[dict], clients: list[int], args) -> None:
    def get(target, c, kind, key):
        return _median([r.get(key, float("nan")) for r in rows if r["target"] == target and r["phase"] == kind
                        and (r["clients"] == c or kind == "alone")])

    dtype = "int8" if args.int8 else "float32"
    print(f"\nquery beside ingestion ({args.model}, {dtype}; query every {1000 / SCALE[args.model]['query_rate']:.0f}"
          f" ms, ingestion {SCALE[args.model]['ingest_texts']} x {INGEST_TOKENS} tokens per request)")
    print(f"{'target':<26} {'clients':>7} {'query alone p50/p99 ms':>24} {'beside ingestion p50/p99':>26} "
          f"{'p99 ratio':>9} {'queries/s':>9} {'ingest alone/s':>14} {'beside query/s':>14} {'ratio':>6}")
    for target in dict.fromkeys(r["target"] for r in rows):
        for c in clients:
            a50, a99 = get(target, c, "alone", "query_p50"), get(target, c, "alone", "query_p99")
            m50, m99 = get(target, c, "mixed", "query_p50"), get(target, c, "mixed", "query_p99")
            ia, im = get(target, c, "ingest", "ingest_texts_s"), get(target, c, "mixed", "ingest_texts_s")
            answered = get(target, c, "mixed", "query_texts_s")  # queries answered (200) per second beside it
            print(f"{target:<26} {c:>7} {a50:>11.1f} / {a99:>9.1f} {m50:>12.1f} / {m99:>10.1f} {m99 / a99:>9.1f} "
                  f"{answered:>9.1f} {ia:>14.1f} {im:>14.1f} {im / ia:>6.2f}")
    print("\nCPU per query alone (server + load generator, ms; warm-ups and idle spinning included): " + ", ".join(
        f"{t} {1000 * get(t, clients[0], 'alone', 'server_cpu_s') / max(1, get(t, clients[0], 'alone', 'query_ok')):.1f}"
        f" + {1000 * get(t, clients[0], 'alone', 'client_cpu_s') / max(1, get(t, clients[0], 'alone', 'query_ok')):.1f}"
        for t in dict.fromkeys(r["target"] for r in rows)))
    errors = [r for r in rows if r.get("query_errors") or r.get("ingest_errors")]
    for r in errors:
        print(f"errors: {r['target']} c={r['clients']} {r['phase']}: query {r.get('query_error_kinds')} "
              f"ingest {r.get('ingest_error_kinds')}")


if __name__ == "__main__":
    raise SystemExit(main())
