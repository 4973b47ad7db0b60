"""What the activator's hop costs a service that scales to zero, while it has a replica.

One embedops server (all-MiniLM-L6-v2, ONNX Runtime, the operator's CPU flags for 2 cores) and the activator
in front of it (`embedops-activator --backend <server>`), both real processes on loopback. The same load goes
straight to the server and through the activator, alternating per round so that a noisy machine hits both
alike: c=1 one 16-token query (p50/p99), and c=16 closed loop of single 32-token texts (texts/s, p99).
Prints a table of both and the ratio activator / direct.

    python -m bench.activator [--rounds 3] [--duration 15]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.loadgen import Request, run_load_sync, summarize
from bench.procs import Server, free_port

REPO = Path(__file__).resolve().parents[1]


def _servers(log_dir: Path) -> tuple[Server, Server]:
    from localcluster.models import minilm_onnx_dir

    port, front, admin = free_port(), free_port(), free_port()
    server = Server("activator-backend", [
        sys.executable, "-m", "embedops_server.cli", "--model-id", str(minilm_onnx_dir()), "--port", str(port),
        "--hostname", "127.0.0.1", "--backend", "onnxruntime", "--pooling", "mean", "--num-threads", "2",
        "--max-batch-tokens", "8192"], port, log_dir=log_dir)
    activator = Server("activator", [
        sys.executable, "-m", "embedops_server.activator", "--backend", f"http://127.0.0.1:{port}",
        "--hostname", "127.0.0.1", "--port", str(front), "--admin-port", str(admin)], front, log_dir=log_dir)
    return server, activator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.activator", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-activator"))
    args = p.parse_args(argv)
    query = [Request({"inputs": "what does the activator cost a scaled-to-zero service while it runs"}, 1)]
    texts = [Request({"inputs": f"passage {i}: " + "embeddings servers batch their inputs by a token budget "
                      * 3}, 1) for i in range(64)]
    scenarios = [("c=1 query", query, 1), ("c=16 texts", texts, 16)]
    server, activator = _servers(args.log_dir)
    rows: dict[tuple[str, str], list] = {}
    with server, activator:
        for r in range(args.rounds):
            order = [("direct", server.url), ("activator", activator.url)]
            for name, base in order if r % 2 == 0 else order[::-1]:
                for label, reqs, c in scenarios:
                    samples, wall = run_load_sync(base + "/embed", reqs, concurrency=c, duration_s=args.duration,
                                                  warmup=20)
                    st = summarize(samples, wall)
                    if st.errors:
                        print(f"round {r + 1} {name} {label}: {st.errors} errors {st.error_kinds}", file=sys.stderr)
                    rows.setdefault((label, name), []).append(st)
    print(f"\n{'scenario':<12} {'target':<10} " + " ".join(f"{'round ' + str(i + 1):>22}" for i in range(args.rounds)))
    for label, _, _ in scenarios:
        for name in ("direct", "activator"):
            cells = [f"{s.texts_s:7.1f}/s p50 {s.p50_ms:5.1f} p99 {s.p99_ms:5.1f}" for s in rows[(label, name)]]
            print(f"{label:<12} {name:<10} " + " ".join(f"{c:>22}" for c in cells))
    print("\nratio activator / direct, per round (throughput; p50; p99):")
    for label, _, _ in scenarios:
        parts = []
        for d, a in zip(rows[(label, "direct")], rows[(label, "activator")]):
            parts.append(f"{a.texts_s / d.texts_s:.2f}; {a.p50_ms / d.p50_ms:.2f}; {a.p99_ms / d.p99_ms:.2f}")
        print(f"  {label:<12} " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
