"""What tracing costs (--otlp-endpoint, issue 54): the same server without and with it, side by side.

Three servers of the same model (all-MiniLM-L6-v2, ONNX Runtime), started together: ``off``; ``on`` exports a span
per request and one per stage (router/tracing.py) over OTLP/gRPC; ``sampled`` a tenth of the traces (the sampler
the operator's `tracing.sampleRatio: 0.1` sets); to a collector in this process (the protocol's own service from
the opentelemetry-proto definitions; it counts what it receives and keeps nothing). Each round runs both workloads
on each server in turn (each server goes first in one round):

- ``lone``: one client, one ~16-token query at a time (what a RAG query path sees): p50, p99;
- ``c16``: 16 clients of single queries: queries/s, p50, p99.

Off costs nothing by construction (the middleware checks one attribute); the rows say what on costs, and the
spans the collector received (8 per request: the request's and its seven stages').

    python -m bench.tracing [--rounds 3] [--duration 15]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
from concurrent import futures
from pathlib import Path

from bench.loadgen import Request, percentile, run_load, summarize

QUERY_TOKENS = 16


def collector():
    """(endpoint, received span count, stop) of an OTLP/gRPC trace endpoint that counts spans."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]
    lock = threading.Lock()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with lock:
                count[0] += n
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"http://127.0.0.1:{port}", (lambda: count[0]), (lambda: server.stop(0))


async def workload(kind: str, url: str, texts: list[str], duration: float) -> dict:
    reqs = [Request({"inputs": t}, 1, 0) for t in texts]
    clients = 1 if kind == "lone" else 16
    samples, wall = await run_load(url + "/embed", reqs, concurrency=clients, duration_s=duration, drain_s=60)
    st = summarize(samples, wall)
    good = [s.latency * 1000 for s in samples if s.ok]
    return {"queries_s": st.texts_s, "p50_ms": percentile(good, 50), "p99_ms": percentile(good, 99), "ok": st.ok,
            "errors": st.errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of each workload")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-tracing"))
    args = p.parse_args(argv)
    from bench.models import minilm_onnx_dir
    from bench.targets import embedops_target
    from bench.textgen import TextGen, load_tokenizer

    endpoint, spans, stop = collector()
    model = minilm_onnx_dir()
    targets = {"off": embedops_target(model, "onnxruntime", log_dir=args.log_dir, name="embedops-onnx",
                                      extra_args=["--pooling", "mean"]),
               "on": embedops_target(model, "onnxruntime", log_dir=args.log_dir, name="embedops-onnx-traced",
                                     extra_args=["--pooling", "mean", "--otlp-endpoint", endpoint]),
               # what the operator's tracing.sampleRatio 0.1 renders
               "sampled": embedops_target(
                   model, "onnxruntime", log_dir=args.log_dir, extra_args=["--pooling", "mean", "--otlp-endpoint",
                                                                           endpoint],
                   name="embedops-onnx-sampled+env.OTEL_TRACES_SAMPLER=parentbased_traceidratio"
                        "+env.OTEL_TRACES_SAMPLER_ARG=0.1")}
    rows: list[dict] = []
    try:
        for t in targets.values():
            t.server.start()
        for t in targets.values():  # a fresh server's first seconds are not the steady state
            asyncio.run(workload("c16", t.server.url, [f"warm-up {i}" for i in range(200)], 5))
        for r in range(args.rounds):
            texts = TextGen(load_tokenizer(model), seed=1000 + r).texts(20000, QUERY_TOKENS)
            order = list(targets)[r % len(targets):] + list(targets)[:r % len(targets)]  # each goes first once
            for kind in ("lone", "c16"):
                for name in order:
                    before = spans()
                    res = asyncio.run(workload(kind, targets[name].server.url, texts, args.duration))
                    row = {"round": r, "workload": kind, "tracing": name, **res}
                    if name != "off":
                        asyncio.run(asyncio.sleep(6))  # the SDK's batch processor exports every 5 s
                        row["spans_per_request"] = (spans() - before) / max(1, res["ok"])
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    finally:
        for t in targets.values():
            t.server.stop()
        stop()
    report(rows)
    return 0


def report(rows: list[dict]) -> None:
    def med(kind, name, key):
        xs = [r[key] for r in rows if r["workload"] == kind and r["tracing"] == name and r.get(key) is not None]
        return statistics.median(xs) if xs else float("nan")

    print("| workload | tracing | queries/s | p50 (ms) | p99 (ms) | spans per request |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in ("lone", "c16"):
        for name in ("off", "on", "sampled"):
            spr = med(kind, name, "spans_per_request")
            print(f"| {kind} | {name} | {med(kind, name, 'queries_s'):.0f} | {med(kind, name, 'p50_ms'):.2f} | "
                  f"{med(kind, name, 'p99_ms'):.2f} | {'' if spr != spr else f'{spr:.2f}'} |")
        for name in ("on", "sampled"):
            print(f"| {kind} | {name} / off | {med(kind, name, 'queries_s') / med(kind, 'off', 'queries_s'):.3f} | "
                  f"{med(kind, name, 'p50_ms') / med(kind, 'off', 'p50_ms'):.3f} | "
                  f"{med(kind, name, 'p99_ms') / med(kind, 'off', 'p99_ms'):.3f} | |")
    print("\n(medians of the rounds; sampled: 10% of the traces, OTEL_TRACES_SAMPLER=parentbased_traceidratio)")


if __name__ == "__main__":
    sys.exit(main())
