"""``python -m bench.sizing``: the seed's models at real size, prepared once and served as the operator
renders them, with their memory and start-up time measured and printed beside the operator's estimate.

For each case it runs, as separate processes (their peaks are their own):
  prepare   ``embedops-server prepare`` into a fresh ONNX cache (export, int8 + gate): time, peak RSS
  serve     ``embedops-server`` on that cache: seconds to /health 200, peak RSS at ready, then a load of
            ingestion requests (32 x 256 tokens; rerank: top-50 x 288-token pairs) and the steady RSS
            after it, the peak during it, and the throughput / latency
and prints one table with the estimate (embedops_server.sizing) and measured / estimate ratios. Then, side by
side on the same graph and the same requests, one after the other while nothing else runs (``--peers``):
  hybrid    bge-m3's /embed_hybrid (dense + sparse + ColBERT, base64) against /embed (dense) on embedops
  tei       TEI 1.9.3's ONNX Runtime backend on the graph embedops serves (skipped in one line when TEI is
            not built: python -m bench.tei build)
  raw       ONNX Runtime in this process on that graph, same threads, pre-tokenized: the ceiling
and prints a second table of throughput (ingestion tokens/s, rerank p50) with the ratios.

    python -m bench.sizing                       # bge-m3 int8 (the seed's CPU ingestion service)
    python -m bench.sizing --cases m3-int8,m3-fp32,rerank-fp32 --threads 2 --peers tei,raw
"""
from __future__ import annotations

import argparse
import contextlib
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
            "--max-input-length", str(args.max_input_length), "--tokenization-workers", str(args.tokenizers),
            "--max-client-batch-size", str(max(32, args.rerank_docs))]
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


class NotReady(RuntimeError):
    pass


@contextlib.contextmanager
def serving(argv: list[str], env: dict, log_name: str, timeout: float):
    """Start a server, wait for /health 200 and yield (process, url, seconds to ready); stop it afterwards."""
    import httpx

    port = argv[argv.index("--port") + 1]
    log_file = open(Path(tempfile.gettempdir()) / log_name, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise NotReady(f"exited {proc.returncode} at start; log {log_file.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise NotReady(f"not ready in {timeout:.0f} s; log {log_file.name}")
            time.sleep(0.2)
        yield proc, url, time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()


def _rerank_p50_ms(client, url: str, pairs: list, rounds: int) -> float:
    lat = []
    for _ in range(rounds):
        t = time.perf_counter()
        client.post(url + "/rerank", json={"query": pairs[0][0], "texts": [d for _, d in pairs]}).raise_for_status()
        lat.append(time.perf_counter() - t)
    return sorted(lat)[len(lat) // 2] * 1000


def run_serve(model: Path, quantize: str | None, task: str, cache: Path, args) -> dict:
    import httpx

    argv = [sys.executable, "-m", "embedops_server.cli", *_server_argv(model, quantize, cache, args),
            "--port", str(free_port()), "--hostname", "127.0.0.1"]
    env = {**_env(), **dict(kv.split("=", 1) for kv in args.server_env)}
    with serving(argv, env, f"bench-sizing-{task}-{quantize or 'fp32'}.log", args.startup_timeout) as (proc, url, ready_s):
        out = {"ready_s": ready_s, "ready_peak_mb": proc_status_kb(proc.pid, "VmHWM") / 1024,
               "ready_rss_mb": proc_status_kb(proc.pid, "VmRSS") / 1024}
        client = httpx.Client(timeout=900)
        inputs, pairs = _workload(model, task, args)
        if pairs:
            out["rerank_p50_ms"] = _rerank_p50_ms(client, url, inputs, args.rounds)
        else:
            out["ingest_tokens_per_s"] = _ingest(client, url + "/embed", {"inputs": inputs}, args.rounds)
            outputs = client.get(url + "/info").json().get("outputs") or []
            if "hybrid" in args.peers and len(outputs) > 1:
                # the same batch, every output the model has from its one forward; base64 keeps ColBERT's
                # 32 x 256 x 1024 floats at 45 MB instead of ~100 MB of JSON numbers
                body = {"inputs": inputs, "outputs": outputs, "encoding_format": "base64"}
                out["hybrid_tokens_per_s"] = _ingest(client, url + "/embed_hybrid", body, args.rounds)
                out["hybrid_outputs"] = outputs
        time.sleep(2)
        out["steady_rss_mb"] = proc_status_kb(proc.pid, "VmRSS") / 1024
        out["peak_rss_mb"] = proc_status_kb(proc.pid, "VmHWM") / 1024
        out["info"] = client.get(url + "/info").json()
        return out


def _ingest(client, url: str, body: dict, rounds: int) -> float:
    """Tokens per second over ``rounds`` sequential requests (the server's own x-compute-tokens count)."""
    tokens = 0
    t = time.perf_counter()
    for _ in range(rounds):
        r = client.post(url, json=body)
        r.raise_for_status()
        tokens += int(r.headers.get("x-compute-tokens", 0))
    return tokens / (time.perf_counter() - t)


def served_graph(model: Path, quantize: str | None, cache: Path) -> Path:
    """The ONNX file the server runs from this cache: the int8 graph prepare made, else the float32 one (the
    folder's onnx/model.onnx, or prepare's export of its weights)."""
    from embedops_server.backends.onnx_export import cache_dir, model_file
    from embedops_server.core.model_info import load_model_info

    info = load_model_info(model)
    fp32 = Path(model_file(info, str(cache)))
    return cache_dir(info, str(cache)) / f"{fp32.stem}.int8.onnx" if quantize else fp32


def _workload(model: Path, task: str, args) -> tuple[list, bool]:
    """The requests' inputs: 32 texts of 256 tokens, or the rerank query paired with its passages."""
    if task == "rerank":
        query = _texts(model, 1, 32)[0]
        return [(query, d) for d in _texts(model, args.rerank_docs, 256)], True
    return _texts(model, 32, 256), False


def run_tei(model: Path, graph: Path, task: str, args) -> dict:
    """TEI's ORT backend on ``graph`` (a folder of the model's config and tokenizer with onnx/ -> graph), the
    same requests as embedops; {"skipped": why} when TEI is not built here or does not start."""
    import httpx

    from . import tei

    why = tei.unavailable_reason()
    if why:
        return {"skipped": why}
    port, prom = tei.two_ports()
    argv = tei.tei_argv(tei.runner_path(), tei.ort_folder(model, graph), port, prom,
                        max_client_batch_size=max(64, args.rerank_docs))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    try:
        with serving(argv, env, f"bench-sizing-tei-{task}-{graph.stem}.log", args.startup_timeout) as (proc, url, ready_s):
            out = {"ready_s": ready_s}
            client = httpx.Client(timeout=900)
            inputs, pairs = _workload(model, task, args)
            if pairs:
                out["rerank_p50_ms"] = _rerank_p50_ms(client, url, inputs, args.rounds)
            else:
                # TEI reports no token count: the tokens are counted as embedops' tokenizer counts them
                n = _token_count(model, inputs)
                t = time.perf_counter()
                for _ in range(args.rounds):
                    client.post(url + "/embed", json={"inputs": inputs}).raise_for_status()
                out["ingest_tokens_per_s"] = n * args.rounds / (time.perf_counter() - t)
            out["peak_rss_mb"] = proc_status_kb(proc.pid, "VmHWM") / 1024
            return out
    except NotReady as e:
        return {"skipped": f"TEI {e}"}


def _token_count(model: Path, texts: list) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return sum(len(e.ids) for e in tok.encode_batch(texts))


def run_raw(model: Path, graph: Path, task: str, args) -> dict:
    """ONNX Runtime in this process on ``graph``: the same batch, pre-tokenized, ``args.threads`` threads, in
    forwards of the server's size (its max-forward-tokens from /info), one after another."""
    from tokenizers import Tokenizer

    from .ceiling import OrtForward, Tokenize

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.no_truncation()
    inputs, pairs = _workload(model, task, args)
    feed = Tokenize(tok, pairs)(inputs)
    tokens = int(feed["attention_mask"].sum())
    fwd = OrtForward(graph, threads=args.threads)
    rows = max(1, args.forward_tokens // feed["input_ids"].shape[1])
    chunks = [{k: v[i:i + rows] for k, v in feed.items()} for i in range(0, len(inputs), rows)]
    fwd({k: v[:1] for k, v in feed.items()})  # warm-up
    lat = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for c in chunks:
            fwd(c)
        lat.append(time.perf_counter() - t)
    out = {"rows_per_forward": rows, "peak_rss_mb": proc_status_kb(os.getpid(), "VmHWM") / 1024}
    if pairs:
        out["rerank_p50_ms"] = sorted(lat)[len(lat) // 2] * 1000
    else:
        out["ingest_tokens_per_s"] = tokens * args.rounds / sum(lat)
    del fwd
    return out


def estimates(model: Path, quantize: str | None, args, info: dict | None) -> dict:
    from embedops_server.backends.base import Backend  # noqa: F401  (the server package is importable)
    from embedops_server.sizing import Geometry, estimate, prepare_estimate

    config = json.loads((model / "config.json").read_text())
    g = Geometry.from_config(config, args.max_input_length)
    forward = (info or {}).get("max_forward_tokens") or 1024
    parallel = (info or {}).get("parallel_forwards") or 1
    e = estimate(g, dtype="int8" if quantize else "float32", max_input_length=args.max_input_length,
                 forward_tokens=forward, parallel_forwards=parallel, tokenizers=args.tokenizers + 1)
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
    p.add_argument("--peers", default="hybrid,tei,raw",
                   help="side-by-side comparisons after each case: hybrid, tei, raw (comma-separated; '' for none)")
    args = p.parse_args(argv)
    args.peers = {x.strip() for x in args.peers.split(",") if x.strip()}

    from . import real_size

    rows = []
    out = REPO / "bench" / "results" / f"sizing-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        builder, quantize, task = CASES[case]
        model = getattr(real_size, builder)()
        cache = Path(args.keep_cache) / case if args.keep_cache else Path(tempfile.mkdtemp(prefix="sizing-"))
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        log(f"{case}: prepare {model.name} (quantize {quantize}) into {cache}")
        prep = run_prepare(model, quantize, cache, args)
        log(f"{case}: prepared in {prep['seconds']:.0f} s, peak {prep['peak_rss_mb']:.0f} MB; serving")
        try:
            serve = run_serve(model, quantize, task, cache, args)
        except Exception as e:  # noqa: BLE001 - one case failing keeps the others' figures
            log(f"{case}: serving failed: {type(e).__name__}: {e}")
            continue
        est = estimates(model, quantize, args, serve.get("info"))
        row = {"case": case, "prepare": prep, "serve": serve, "estimate": est}
        graph = served_graph(model, quantize, cache)
        args.forward_tokens = (serve.get("info") or {}).get("max_forward_tokens") or 1024
        if "tei" in args.peers:
            log(f"{case}: TEI on {graph.name}")
            row["tei"] = run_tei(model, graph, task, args)
        if "raw" in args.peers:
            log(f"{case}: raw ONNX Runtime forward on {graph.name}")
            row["raw"] = run_raw(model, graph, task, args)
        rows.append(row)
        out.parent.mkdir(parents=True, exist_ok=True)  # after every case: a later one failing keeps these
        out.write_text(json.dumps(rows, indent=1, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o)))
        log(f"{case}: done; results so far in {out}")
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(render(rows, args))
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
    if any(k in r for r in rows for k in ("tei", "raw")) or any("hybrid_tokens_per_s" in r["serve"] for r in rows):
        lines += ["", throughput_table(rows)]
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> str:
    """Embedops beside TEI and the raw forward on the same graph (ingestion tokens/s, higher is better; rerank
    p50 ms, lower is better; ratios > 1 mean embedops is ahead), and the hybrid request against dense-only."""
    head = (f"{'case':<12} {'metric':<14} {'embedops':>9} {'TEI':>9} {'/ TEI':>6} {'raw fwd':>9} {'/ raw':>6} "
            f"{'hybrid':>9} {'hyb/dense':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        s, tei, raw = r["serve"], r.get("tei") or {}, r.get("raw") or {}
        rerank = "rerank_p50_ms" in s
        key = "rerank_p50_ms" if rerank else "ingest_tokens_per_s"
        ours = s[key]

        def ratio(other):
            if not other:
                return "-"
            return f"{(other / ours if rerank else ours / other):.2f}"
        fmt = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        hybrid = s.get("hybrid_tokens_per_s")
        lines.append(
            f"{r['case']:<12} {'p50 ms' if rerank else 'tokens/s':<14} {ours:>9.0f} {fmt(tei.get(key)):>9} "
            f"{ratio(tei.get(key)):>6} {fmt(raw.get(key)):>9} {ratio(raw.get(key)):>6} {fmt(hybrid):>9} "
            f"{(f'{hybrid / ours:.2f}' if hybrid else '-'):>9}")
        if tei.get("skipped"):
            lines.append(f"{'':<12} TEI: {tei['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
