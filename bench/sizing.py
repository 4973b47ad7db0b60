"""``python -m bench.sizing``: the seed's models at real size, prepared once and served as the operator
renders them, with their memory and start-up time measured and printed beside the operator's estimate.

For each case it runs, as separate processes (their peaks are their own):
  prepare   ``embedops-server prepare`` into a fresh ONNX cache (export, int8 + gate): time, peak RSS
  serve     ``embedops-server`` on that cache: seconds to /health 200, peak RSS at ready, then a load of
            ingestion requests (32 x 256 tokens; rerank: top-50 x 288-token pairs) and the steady RSS
            after it, the peak during it, and the throughput / latency
and prints one table with the estimate (embedops_server.sizing) and measured / estimate ratios.

    python -m bench.sizing                       # bge-m3 int8 (the seed's CPU ingestion service)
    python -m bench.sizing --cases m3-int8,m3-fp32,rerank-fp32 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .logs import log
from .procs import free_port, proc_status_kb

REPO = Path(__file__).resolve().parent.parent
CASES = {
    # name: (model, quantize, task)
    "m3-int8": ("bge_m3", "int8", "embed"),
    "m3-fp32": ("bge_m3", None, "embed"),
    "rerank-fp32": ("bge_reranker", None, "rerank"),
}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO)])}


def _server_argv(model: Path, quantize: str | None, cache: Path, args) -> list[str]:
    argv = ["--model-id", str(model), "--backend", "onnxruntime", "--num-threads", str(args.threads),
            "--onnx-cache", str(cache), "--max-batch-tokens", str(args.max_batch_tokens),
            "--max-input-length", str(args.max_input_length), "--tokenization-workers", str(args.tokenizers)]
    if quantize:
        argv += ["--quantize", quantize]
    return argv


def run_prepare(model: Path, quantize: str | None, cache: Path, args) -> dict:
    argv = [sys.executable, "-m", "embedops_server.cli", "prepare", *_server_argv(model, quantize, cache, args)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"prepare failed ({proc.returncode}): {err[-2000:]}")
    return {"seconds": time.perf_counter() - t0, "peak_rss_mb": usage.ru_maxrss / 1024,
            "cache_mb": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2**20}


def _texts(model: Path, n: int, tokens: int) -> list[str]:
    from .textgen import TextGen, load_tokenizer

    return TextGen(load_tokenizer(model)).texts(n, tokens)


def run_serve(model: Path, quantize: str | None, task: str, cache: Path, args) -> dict:
    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "embedops_server.cli", *_server_argv(model, quantize, cache, args),
            "--port", str(port), "--hostname", "127.0.0.1"]
    log_file = open(Path(tempfile.gettempdir()) / f"bench-sizing-{task}-{quantize or 'fp32'}.log", "w")
    t0 = time.perf_counter()
    env = {**_env(), **dict(kv.split("=", 1) for kv in args.server_env)}
    proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}; log {log_file.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.startup_timeout:
                raise RuntimeError(f"not ready in {args.startup_timeout} s; log {log_file.name}")
            time.sleep(0.2)
        ready_s = time.perf_counter() - t0
        out = {"ready_s": ready_s, "ready_peak_mb": proc_status_kb(proc.pid, "VmHWM") / 1024,
               "ready_rss_mb": proc_status_kb(proc.pid, "VmRSS") / 1024}
        client = httpx.Client(timeout=900)
        latencies = []
        if task == "rerank":
            query = _texts(model, 1, 32)[0]
            docs = _texts(model, args.rerank_docs, 256)
            for _ in range(args.rounds):
                t = time.perf_counter()
                r = client.post(url + "/rerank", json={"query": query, "texts": docs})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t)
            out["rerank_p50_ms"] = sorted(latencies)[len(latencies) // 2] * 1000
        else:
            texts = _texts(model, 32, 256)
            tokens = 0
            t = time.perf_counter()
            for _ in range(args.rounds):
                r = client.post(url + "/embed", json={"inputs": texts})
                r.raise_for_status()
                tokens += int(r.headers.get("x-compute-tokens", 0))
            out["ingest_tokens_per_s"] = tokens / (time.perf_counter() - t)
        time.sleep(2)
        out["steady_rss_mb"] = proc_status_kb(proc.pid, "VmRSS") / 1024
        out["peak_rss_mb"] = proc_status_kb(proc.pid, "VmHWM") / 1024
        out["info"] = client.get(url + "/info").json()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()


def estimates(model: Path, quantize: str | None, args, info: dict | None) -> dict:
    from embedops_server.backends.base import Backend  # noqa: F401  (the server package is importable)
    from embedops_server.sizing import Geometry, estimate, prepare_estimate

    config = json.loads((model / "config.json").read_text())
    g = Geometry.from_config(config, args.max_input_length)
    forward = (info or {}).get("max_forward_tokens") or 1024
    parallel = (info or {}).get("parallel_forwards") or 1
    e = estimate(g, dtype="int8" if quantize else "float32", max_input_length=args.max_input_length,
                 forward_tokens=forward, parallel_forwards=parallel, tokenizers=args.tokenizers + 2)
    has_onnx = (model / "onnx" / "model.onnx").exists()
    return {"serve": e, "prepare": prepare_estimate(g, quantize=bool(quantize), export=not has_onnx),
            "parameters": g.parameters}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sizing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="m3-int8", help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--threads", type=int, default=min(4, len(os.sched_getaffinity(0))))
    p.add_argument("--tokenizers", type=int, default=1, help="tokenization workers (the operator: cores // 2)")
    p.add_argument("--max-input-length", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rerank-docs", type=int, default=50)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--server-env", action="append", default=[], metavar="K=V",
                   help="environment of the server process (e.g. MALLOC_ARENA_MAX=2), repeatable")
    p.add_argument("--keep-cache", help="prepare into this folder and keep it (default: a temporary one)")
    args = p.parse_args(argv)

    from . import real_size

    rows = []
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        builder, quantize, task = CASES[case]
        model = getattr(real_size, builder)()
        cache = Path(args.keep_cache) / case if args.keep_cache else Path(tempfile.mkdtemp(prefix="sizing-"))
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        log(f"{case}: prepare {model.name} (quantize {quantize}) into {cache}")
        prep = run_prepare(model, quantize, cache, args)
        log(f"{case}: prepared in {prep['seconds']:.0f} s, peak {prep['peak_rss_mb']:.0f} MB; serving")
        serve = run_serve(model, quantize, task, cache, args)
        est = estimates(model, quantize, args, serve.get("info"))
        rows.append({"case": case, "prepare": prep, "serve": serve, "estimate": est})
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(render(rows, args))
    out = REPO / "bench" / "results" / f"sizing-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o)))
    log(f"results: {out}")
    return 0


def render(rows: list[dict], args) -> str:
    mb = 2 ** 20
    lines = [f"real-size models, {args.threads} threads, max input {args.max_input_length} tokens, "
             f"max batch tokens {args.max_batch_tokens} (MB; ratio = measured / estimate)",
             f"{'case':<12} {'params':>7} {'prep s':>7} {'prep peak':>9} {'est':>6} {'ratio':>5} {'cache':>6} "
             f"{'ready s':>7} {'ready pk':>8} {'peak':>6} {'est':>6} {'ratio':>5} {'steady':>6} {'throughput':>16}"]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        p, s, e = r["prepare"], r["serve"], r["estimate"]
        est = e["serve"].total / mb
        pest = e["prepare"] / mb
        tput = (f"{s['ingest_tokens_per_s']:.0f} tok/s" if "ingest_tokens_per_s" in s
                else f"p50 {s['rerank_p50_ms']:.0f} ms")
        lines.append(
            f"{r['case']:<12} {e['parameters'] / 1e6:>6.0f}M {p['seconds']:>7.0f} {p['peak_rss_mb']:>9.0f} "
            f"{pest:>6.0f} {p['peak_rss_mb'] / pest:>5.2f} {p['cache_mb']:>6.0f} {s['ready_s']:>7.1f} "
            f"{s['ready_peak_mb']:>8.0f} {s['peak_rss_mb']:>6.0f} {est:>6.0f} {s['peak_rss_mb'] / est:>5.2f} "
            f"{s['steady_rss_mb']:>6.0f} {tput:>16}")
        lines.append(f"{'':<12} estimate: {e['serve'].describe()}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
