"""RSS soak: ``python -m bench --soak 600`` keeps the embedops server busy for that long and samples RSS.

Traffic: closed loop at concurrency 16, alternating single short texts and 32-text batches of mixed
lengths (16-512 tokens), so the tokenizer, the queue and many padded shapes are exercised. RSS is sampled
every 5 s; the report gives start (after warm-up), end, max, and the least-squares slope over the whole
run and over its second half (MB/min). Flat = second-half slope within +/-1 MB/min.
"""
from __future__ import annotations

import threading
import time

from .loadgen import Request, run_load_sync, summarize
from .models import minilm_dir
from .targets import embedops_target
from .textgen import TextGen, load_tokenizer


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute; 0 for fewer than 2 points."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    if den == 0:
        return 0.0
    return sum((t - mx) * (v - my) for t, v in points) / den * 60.0


def run_soak(args) -> dict:
    from pathlib import Path

    from .logs import log

    model = Path(args.model_id) if args.model_id else minilm_dir()
    tok = load_tokenizer(model)
    gen = TextGen(tok, seed=args.seed)
    out = Path(args.out)
    backend = args.onnx_backend_name
    name = "embedops-onnx"
    if args.targets and args.targets[0].startswith("embedops-torch"):
        backend, name = "torch", "embedops-torch"
    t = embedops_target(model, backend, log_dir=out / "logs", name=name, extra_args=args.embedops_args)
    singles = gen.texts(512, 32)
    batches = [gen.texts(32, (16, 512)) for _ in range(16)]
    reqs = []
    for i, s in enumerate(singles):
        reqs.append(Request(t.embed_body([s]), 1, 32))
        if i % 16 == 0:
            b = batches[(i // 16) % len(batches)]
            reqs.append(Request(t.embed_body(b), len(b), sum(gen.count(b))))
    samples_rss: list[tuple[float, float]] = []
    stop = threading.Event()
    with t.server:
        log(f"soak: {name} up, {args.soak:.0f}s of load at concurrency 16")
        # warm-up: every shape class once, then start the clock
        run_load_sync(t.embed_url, reqs, concurrency=16, max_requests=len(reqs), duration_s=20,
                      check=t.embed_check)
        t0 = time.perf_counter()

        def sampler():
            while not stop.is_set():
                samples_rss.append((time.perf_counter() - t0, t.server.rss_mb()))
                stop.wait(5.0)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        all_samples = []
        end = t0 + args.soak
        while time.perf_counter() < end:  # bounded chunks, each stops by itself
            chunk = min(30.0, end - time.perf_counter())
            s, _ = run_load_sync(t.embed_url, reqs, concurrency=16, duration_s=chunk, check=t.embed_check,
                                 drain_s=60)
            all_samples += s
            log(f"soak: {time.perf_counter() - t0:.0f}s, RSS {t.server.rss_mb():.1f} MB, "
                f"{sum(x.ok for x in s)} ok / {len(s)}")
        stop.set()
        th.join(timeout=6)
        samples_rss.append((time.perf_counter() - t0, t.server.rss_mb()))
        peak = t.server.peak_rss_mb()
    st = summarize(all_samples)
    half = [p for p in samples_rss if p[0] >= samples_rss[-1][0] / 2]
    res = {
        "target": name, "duration_s": args.soak, "load": st.as_dict(),
        "rss_start_mb": samples_rss[0][1], "rss_end_mb": samples_rss[-1][1],
        "rss_max_mb": max(v for _, v in samples_rss), "peak_rss_mb": peak,
        "slope_mb_per_min": slope_mb_per_min(samples_rss),
        "slope_second_half_mb_per_min": slope_mb_per_min(half),
        "samples": samples_rss,
    }
    res["flat"] = abs(res["slope_second_half_mb_per_min"]) <= 1.0
    print(f"soak {name} {args.soak:.0f}s: RSS start {res['rss_start_mb']:.1f} MB, end {res['rss_end_mb']:.1f} MB, "
          f"max {res['rss_max_mb']:.1f} MB; slope {res['slope_mb_per_min']:+.2f} MB/min overall, "
          f"{res['slope_second_half_mb_per_min']:+.2f} MB/min second half -> "
          f"{'flat' if res['flat'] else ('GROWING' if res['slope_second_half_mb_per_min'] > 0 else 'shrinking')}; {st.ok} requests ok, {st.errors} errors, "
          f"{st.texts_s:.1f} texts/s")
    return res
