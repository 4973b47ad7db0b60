"""``python -m bench.colbert_memory``: what large ColBERT responses cost the server's memory, side by side.

bge-m3's /embed_hybrid returns one 1024-float vector per token: a request of 64 inputs x 512 tokens answers
134 MB of float32, ~440 MB as JSON floats. This starts the server on a random model in bge-m3's layout (hidden
1024, the real ColBERT size; 2 layers, so the forwards are quick and the responses dominate), sends
``--concurrency`` such requests at once (JSON floats, then base64), and samples the server's resident memory:
idle, and the peak while they are answered. The same is done with the server of another checkout
(``--compare PATH``, e.g. a ``git worktree`` of an older commit), one after the other in one run, so the table
compares like with like (``--rounds``: interleaved rounds; the worst extra memory and the best time are kept). The extra memory is printed per byte of the float32 outputs the requests returned:
that ratio is what the operator's estimate uses (embedops_server.sizing).

    python -m bench.colbert_memory --compare /tmp/embedops-before
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from .logs import log
from .procs import free_port, proc_status_kb

REPO = Path(__file__).resolve().parent.parent


def _sample_peak(pid: int, stop: threading.Event, out: list) -> None:
    peak = 0
    while not stop.is_set():
        peak = max(peak, proc_status_kb(pid, "VmRSS"))
        time.sleep(0.02)
    out.append(peak)


def measure(server_root: Path, model: Path, texts: list[str], args) -> dict:
    import httpx

    from .sizing import serving

    env = {**os.environ, "PYTHONPATH": str(server_root / "server")}
    port = free_port()
    argv = [sys.executable, "-m", "embedops_server.cli", "--model-id", str(model), "--backend", "onnxruntime",
            "--num-threads", str(args.threads), "--max-batch-tokens", "8192", "--max-input-length", "512",
            "--max-client-batch-size", str(len(texts)), "--outputs", "dense,sparse,colbert",
            "--onnx-cache", str(model.parent / f"cache-{server_root.name}"), "--port", str(port)]
    out: dict = {}
    with serving(argv, env, f"colbert-memory-{server_root.name}.log", 600) as (proc, url, _):
        with httpx.Client(timeout=600) as client:
            client.post(url + "/embed_hybrid", json={"inputs": texts[:2]}).raise_for_status()  # warm
            time.sleep(1)
            for fmt in ("float", "base64"):
                idle = proc_status_kb(proc.pid, "VmRSS")
                stop, peak = threading.Event(), []
                sampler = threading.Thread(target=_sample_peak, args=(proc.pid, stop, peak))
                sampler.start()
                body = {"inputs": texts, "encoding_format": fmt}
                t = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                    answers = list(pool.map(lambda _: client.post(url + "/embed_hybrid", json=body),
                                            range(args.concurrency)))
                seconds = time.perf_counter() - t
                stop.set()
                sampler.join()
                for a in answers:
                    a.raise_for_status()
                rows = answers[0].json()
                if fmt == "float":
                    floats = sum(len(r["colbert"]) * len(r["colbert"][0]) for r in rows)
                else:
                    floats = sum(len(r["colbert"]) * 3 // 4 // 4 for r in rows)
                raw_mb = floats * 4 * args.concurrency / 1e6
                out[fmt] = {"idle_mb": idle / 1024, "peak_mb": peak[0] / 1024, "raw_mb": raw_mb,
                            "body_mb": len(answers[0].content) * args.concurrency / 1e6, "seconds": seconds,
                            "chunked": answers[0].headers.get("transfer-encoding") == "chunked"}
                del answers, rows
                time.sleep(1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=64, help="inputs per request (the example's maxClientBatchSize)")
    p.add_argument("--tokens", type=int, default=500, help="tokens per input (maxInputLength 512)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="measurements per checkout, interleaved")
    p.add_argument("--compare", action="append", default=[], metavar="CHECKOUT",
                   help="another checkout's root whose server is measured the same way, after this one")
    args = p.parse_args(argv)

    from .m3_model import build_m3_folder
    from .textgen import TextGen, load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-colbert-"))
    try:
        model = build_m3_folder(tmp / "m3", hidden=1024, layers=2, max_positions=514)
        texts = TextGen(load_tokenizer(model), seed=7).texts(args.inputs, args.tokens)
        roots = [REPO] + [Path(c).resolve() for c in args.compare]
        runs: dict[Path, list[dict]] = {root: [] for root in roots}
        for r in range(args.rounds):  # interleaved: a noisy neighbour weighs on every checkout alike
            for root in roots:
                log(f"round {r + 1}: measuring {root}")
                runs[root].append(measure(root, model, texts, args))
        # memory: the worst round's extra; time: the best round (the least disturbed)
        results = {root: {fmt: {**max(rs, key=lambda x: x[fmt]["peak_mb"] - x[fmt]["idle_mb"])[fmt],
                                "seconds": min(x[fmt]["seconds"] for x in rs)}
                          for fmt in ("float", "base64")} for root, rs in runs.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{args.concurrency} concurrent /embed_hybrid requests of {args.inputs} x ~{args.tokens} tokens "
          f"(dense + sparse + ColBERT 1024-d), {args.threads} threads; MB")
    print(f"{'server':<28} {'format':<7} {'idle':>7} {'peak':>7} {'extra':>7} {'float32 out':>11} "
          f"{'extra/out':>9} {'body':>7} {'s':>6} {'streamed':>8}")
    base = results[REPO]
    for root, res in results.items():
        for fmt, r in res.items():
            extra = r["peak_mb"] - r["idle_mb"]
            print(f"{str(root)[-28:]:<28} {fmt:<7} {r['idle_mb']:>7.0f} {r['peak_mb']:>7.0f} {extra:>7.0f} "
                  f"{r['raw_mb']:>11.0f} {extra / r['raw_mb']:>9.2f} {r['body_mb']:>7.0f} {r['seconds']:>6.1f} "
                  f"{'yes' if r['chunked'] else 'no':>8}")
    for root in roots[1:]:
        for fmt in ("float", "base64"):
            ours = base[fmt]["peak_mb"] - base[fmt]["idle_mb"]
            theirs = results[root][fmt]["peak_mb"] - results[root][fmt]["idle_mb"]
            print(f"extra memory, {fmt}: this checkout / {root.name} = {ours / theirs:.2f}; time (best of "
                  f"{args.rounds}): {base[fmt]['seconds'] / results[root][fmt]['seconds']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
