"""Table with ratios, PNG plots, and the small parsers the runner needs."""
from __future__ import annotations

import math
import re
from pathlib import Path

from .tei import is_tei, peer_for

EMBEDOPS = ("embedops-onnx", "embedops-torch")


def embedops_targets(res: dict) -> list[str]:
    """embedops targets in this result, variants (embedops-onnx+num-threads=1 ...) included."""
    names = {_base(r["target"]) for r in res["rows"] if r["target"].startswith("embedops-")}
    return sorted(names, key=lambda n: (n.split("+")[0] not in EMBEDOPS, n))


def _base(target: str) -> str:
    return target.split("/")[0]


def _f(x, fmt="{:.1f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def index(res: dict) -> dict:
    """(scenario, target) -> row (targets without their '/rerank' suffix)."""
    return {(r["scenario"], _base(r["target"])): r for r in res["rows"]}


SCEN_METRIC = {  # the figure each scenario is judged on
    "1-online": ("p50_ms", "lower"),
    "3-ingest": ("tokens_s", "higher"),
    "4-rerank": ("p50_ms", "lower"),
    "5-mixed": ("tokens_s", "higher"),
}


def metric_for(scenario: str) -> tuple[str, str]:
    if scenario.startswith("2-"):
        return "texts_s", "higher"
    return SCEN_METRIC.get(scenario, ("req_s", "higher"))


def ceiling_for(scenario: str, target: str) -> str:
    b = "onnx" if target.split("+")[0].endswith("onnx") else "torch"
    if scenario == "5-mixed":
        return f"ceiling-{b}-uniform"
    return f"ceiling-{b}"


def ratios(res: dict) -> list[dict]:
    """embedops vs its ceiling (same backend, tokenization included) and vs each peer, per scenario."""
    idx = index(res)
    out = []
    scenarios = sorted({r["scenario"] for r in res["rows"]}, key=_scen_key)
    for s in scenarios:
        m, better = metric_for(s)
        for e in embedops_targets(res):
            er = idx.get((s, e))
            if not er or er.get("na") or not er.get("ok"):
                continue
            row = {"scenario": s, "target": e, "metric": m, "value": er.get(m)}
            c = idx.get((s, ceiling_for(s, e)))
            if c:
                row["ceiling"] = c.get(m)
                row["vs_ceiling"] = _ratio(er.get(m), c.get(m), better)
                if s == "1-online":
                    row["over_ceiling_ms"] = er["p50_ms"] - c["p50_ms"]
            for peer in ("infinity", "naive-encode", "inline-encode"):
                p = idx.get((s, peer))
                if p and p.get(m) and not p.get("na"):
                    row[f"vs_{peer}"] = _ratio(er.get(m), p.get(m), better)
                    if "p99_ms" in p and p.get("kind") == "http":
                        row[f"p99_vs_{peer}"] = _ratio(er.get("p99_ms"), p.get("p99_ms"), "lower")
            out.append(row)
    return out


def _ratio(a, b, better: str) -> float:
    """A 'goodness' ratio: > 1 means embedops is better (throughput a/b, latency b/a)."""
    try:
        if not a or not b:
            return math.nan
        return a / b if better == "higher" else b / a
    except TypeError:
        return math.nan


def _scen_key(s: str):
    m = re.match(r"(\d+)-c?(\d+)?", s)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (99, 0)


def table(res: dict) -> str:
    lines = []
    hdr = f"{'scenario':<10} {'target':<26} {'c':>3} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'texts/s':>8} " \
          f"{'tokens/s':>9} {'err':>4}  notes"
    lines += ["", hdr, "-" * len(hdr)]
    for r in sorted(res["rows"], key=lambda r: (_scen_key(r["scenario"]), r.get("kind", ""), r["target"])):
        if r.get("na"):
            lines.append(f"{r['scenario']:<10} {r['target']:<26} {'':>3} n/a: {r['na']}")
            continue
        note = r.get("batch", "") or (f"avg batch {r['avg_batch']:.1f}" if r.get("avg_batch") else "")
        if r.get("config"):
            note += f" [{r['config']}]"
        if r.get("server_cpu_ms"):  # CPU per request: the server's (every thread) and the load generator's
            note += f" | cpu/req server {r['server_cpu_ms']:.2f} client {r['client_cpu_ms']:.2f} ms"
        sp = r.get("server_p50_ms") or {}
        if sp:
            note += (" | server p50: total {:.1f} tok {:.1f} queue {:.1f} infer {:.1f}".format(
                sp.get("total", math.nan), sp.get("tokenization", math.nan), sp.get("queue", math.nan),
                sp.get("inference", math.nan)))
        lines.append(
            f"{r['scenario']:<10} {_base(r['target']):<26} {r.get('concurrency') or '':>3} {_f(r.get('p50_ms')):>8} "
            f"{_f(r.get('p99_ms')):>8} {_f(r.get('req_s')):>8} {_f(r.get('texts_s')):>8} "
            f"{_f(r.get('tokens_s'), '{:.0f}'):>9} {r.get('errors', 0) or '':>4}  {note}")
    lines += ["", "ratios (>1 = embedops better; throughput a/b, latency b/a; ceiling = same backend, "
              "tokenization included)"]
    hdr = f"{'scenario':<10} {'target':<26} {'metric':<9} {'value':>9} {'/ceiling':>9} {'/infinity':>10} " \
          f"{'/naive':>8} {'/inline':>8} {'p99/inf':>8} {'+ms vs ceil':>11}"
    lines += [hdr, "-" * len(hdr)]
    for r in ratios(res):
        lines.append(
            f"{r['scenario']:<10} {r['target']:<26} {r['metric']:<9} {_f(r.get('value')):>9} "
            f"{_f(r.get('vs_ceiling'), '{:.2f}'):>9} {_f(r.get('vs_infinity'), '{:.2f}'):>10} "
            f"{_f(r.get('vs_naive-encode'), '{:.2f}'):>8} {_f(r.get('vs_inline-encode'), '{:.2f}'):>8} "
            f"{_f(r.get('p99_vs_infinity'), '{:.2f}'):>8} {_f(r.get('over_ceiling_ms'), '{:+.1f}'):>11}")
    lines += tei_ratio_lines(res)
    lines += tail_lines(res)
    if res.get("rss"):
        lines += ["", "peak RSS (MB): " + ", ".join(f"{k} {v['peak_rss_mb']:.0f}" + (
            f" (GPU {v['gpu_mem_mb']:.0f} MB)" if v.get("gpu_mem_mb") else "") for k, v in res["rss"].items())]
    if res.get("errors"):
        lines += ["", "could not run:"] + [f"  {k}: {v.splitlines()[0][:300]}" for k, v in res["errors"].items()]
    m = res.get("meta", {})
    if m.get("machine_before"):
        mb, ma = m["machine_before"], m.get("machine_after", {})
        lines += ["", f"machine: {mb.get('cpus')} CPUs {mb.get('cpu_model')}, load avg before "
                      f"{mb.get('loadavg')}, after {ma.get('loadavg')}; {m.get('total_s')} s total"]
    return "\n".join(lines)


TAIL_COLS = ("client", "parse", "tokenize", "queue", "slot", "forward", "wake", "respond")


def tail_lines(res: dict) -> list[str]:
    """Where the time of the slowest 1% of requests went, against the middle band (p45-p55), from embedops'
    Server-Timing stages (ms, means; `client` = client latency - server total: the HTTP server, the socket and
    the load generator). The stage whose figure grows most from `mid` to `p99+` is where the tail comes from."""
    rows = [r for r in res["rows"] if r.get("tail_ms")]
    if not rows:
        return []
    hdr = (f"{'scenario':<10} {'target':<26} {'c':>3} {'band':<5} {'ms':>7} "
           + " ".join(f"{c[:8]:>8}" for c in TAIL_COLS) + f" {'batch':>6} {'beside':>6}")
    lines = ["", "where the time goes: slowest 1% (p99+) against the middle (p45-p55), server stages in ms",
             hdr, "-" * len(hdr)]
    for r in sorted(rows, key=lambda r: (_scen_key(r["scenario"]), r["target"])):
        for band, d in (("mid", r.get("median_ms") or {}), ("p99+", r["tail_ms"])):
            lines.append(
                f"{r['scenario']:<10} {_base(r['target']):<26} {r.get('concurrency') or '':>3} {band:<5} "
                f"{_f(d.get('latency')):>7} " + " ".join(f"{_f(d.get(c), '{:.2f}'):>8}" for c in TAIL_COLS)
                + f" {_f(d.get('batch')):>6} {_f(d.get('beside'), '{:.2f}'):>6}")
        lines.append(f"{'':<10} {'':<26} {'':>3} {'n':<5} {r.get('tail_n', 0):>7} requests in the p99+ band")
    return lines


def targets_check(res: dict) -> list[str]:
    """The issue's CPU targets, met or missed."""
    idx, out = index(res), []
    for e in embedops_targets(res):
        r = idx.get(("3-ingest", e)); c = idx.get(("3-ingest", ceiling_for("3-ingest", e)))
        if r and c and r.get("tokens_s"):
            v = r["tokens_s"] / c["tokens_s"]
            out.append(f"{e}: saturated tokens/s {v:.0%} of raw forward (target >= 90%): "
                       f"{'met' if v >= 0.9 else 'MISSED'}")
        r = idx.get(("2-c16", e)); i = idx.get(("2-c16", "infinity"))
        if r and i and r.get("req_s") and i.get("req_s"):
            v = r["req_s"] / i["req_s"]
            ok = v >= 3 and r["p99_ms"] < i["p99_ms"]
            out.append(f"{e}: c16 single-text {v:.2f}x infinity, p99 {r['p99_ms']:.0f} vs {i['p99_ms']:.0f} ms "
                       f"(target >= 3x, lower p99): {'met' if ok else 'MISSED'}")
        r = idx.get(("1-online", e)); c = idx.get(("1-online", ceiling_for("1-online", e)))
        if r and c and r.get("p50_ms"):
            d = r["p50_ms"] - c["p50_ms"]
            out.append(f"{e}: c1 p50 {r['p50_ms']:.2f} ms = raw {c['p50_ms']:.2f} ms {d:+.2f} ms (target <= +3 ms): "
                       f"{'met' if d <= 3 else 'MISSED'}")
    return out


def plots(res: dict, out: Path, stamp: str) -> list[Path]:
    """Throughput and p99 against concurrency (scenarios 1 and 2), one line per HTTP target."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return []
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in res["rows"]:
        if r.get("kind") == "http" and (r["scenario"] == "1-online" or r["scenario"].startswith("2-")) \
                and r.get("ok"):
            series.setdefault(_base(r["target"]), []).append((r["concurrency"], r["req_s"], r["p99_ms"]))
    if not series:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in sorted(series.items()):
        pts.sort()
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1] for p in pts], marker="o", label=name)
        axes[1].plot(xs, [p[2] for p in pts], marker="o", label=name)
    idx = index(res)
    for s, c in ((s, int(s.split("-c")[1])) for s, _ in idx if s.startswith("2-c")):
        pass
    axes[0].set(xscale="log", xlabel="concurrent clients (single texts)", ylabel="requests/s",
                title="throughput vs concurrency")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent clients (single texts)", ylabel="p99 latency (ms)",
                title="p99 vs concurrency")
    for a in axes:
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"all-MiniLM-L6-v2, {res.get('meta', {}).get('machine_before', {}).get('cpus', '?')} CPUs, {stamp}")
    fig.tight_layout()
    p = out / f"concurrency-{stamp}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    (out / "concurrency-latest.png").write_bytes(p.read_bytes())
    return [p]


_GPU_RE = re.compile(r'^([a-zA-Z_:]*(?:gpu|cuda)[a-zA-Z_:]*(?:memory|mem)[a-zA-Z_:]*)(\{[^}]*\})?\s+([0-9.eE+]+)',
                     re.M)


def gpu_memory_from_metrics(metrics: str | None, info: str | None) -> float | None:
    """Peak GPU memory in MB from the server's /metrics (a gauge named like *gpu*memory* or *cuda*mem*,
    bytes) or /info (a key like ``gpu_memory_*``); None when the server reports none."""
    best = None
    if metrics:
        for name, _labels, val in _GPU_RE.findall(metrics):
            v = float(val)
            if "max" in name or "peak" in name or best is None:
                best = v / 2**20 if v > 2**20 or "bytes" in name else v
    if best is None and info:
        import json

        try:
            d = json.loads(info)
        except ValueError:
            d = {}
        for k, v in _walk(d):
            if re.search(r"(gpu|cuda).*mem", k) and isinstance(v, (int, float)):
                best = v / 2**20 if "bytes" in k or v > 2**20 else v
    return best


def _walk(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _walk(v, f"{prefix}{k}_".lower())
    else:
        yield prefix.rstrip("_"), d


def batch_counters(metrics: str | None) -> dict | None:
    """Totals of the server's batch histograms (te_batch_next_size / te_batch_next_tokens)."""
    if not metrics:
        return None
    vals = {}
    for line in metrics.splitlines():
        if line.startswith(("te_batch_next_size_sum", "te_batch_next_size_count", "te_batch_next_tokens_sum")):
            name, _, v = line.rpartition(" ")
            vals[name.split("{")[0]] = float(v)
    if "te_batch_next_size_count" not in vals:
        return None
    return {"batches": vals["te_batch_next_size_count"], "inputs": vals.get("te_batch_next_size_sum", 0.0),
            "tokens": vals.get("te_batch_next_tokens_sum", 0.0)}


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (scenario, target): the median of each numeric field over rounds (n/a rows kept)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["target"]), []).append(r)
    out = []
    for (_s, _t), rs in groups.items():
        if len(rs) == 1:
            out.append(dict(rs[0], rounds=1))
            continue
        m = dict(rs[-1])
        for k, v in rs[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("concurrency", "round"):
                xs = sorted(x[k] for x in rs if isinstance(x.get(k), (int, float)) and not (
                    isinstance(x.get(k), float) and math.isnan(x[k])))
                if xs:
                    m[k] = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
        m["rounds"] = len(rs)
        out.append(m)
    return out


def tei_ratio_lines(res: dict) -> list[str]:
    """embedops against TEI per scenario (>1 = embedops better): the scenario's figure, and p99 for HTTP
    rows; float32 embedops against ``tei`` and ``tei-candle``, int8 against ``tei+int8``; and the CPU each
    server spent per request (ms, every thread; on a machine with as many cores as the load needs, throughput
    is cores / (server + client CPU per request))."""
    idx = index(res)
    if not any(is_tei(t) for _, t in idx):
        return []
    out = ["", "embedops vs TEI (>1 = embedops better; throughput a/b, latency b/a; same graph: int8 vs tei+int8)",
           f"{'scenario':<10} {'target':<28} {'metric':<9} {'value':>9} {'TEI':>9} {'/tei':>6} "
           f"{'p99/tei':>8} {'/candle':>8} {'cpu/req':>8} {'TEI cpu':>8}"]
    out.append("-" * len(out[-1]))
    for s in sorted({s for s, _ in idx}, key=_scen_key):
        m, better = metric_for(s)
        for e in embedops_targets(res):
            er = idx.get((s, e))
            if not er or er.get("na") or not er.get("ok"):
                continue
            peer = idx.get((s, peer_for(e)))
            cand = idx.get((s, "tei-candle")) if peer_for(e) == "tei" else None
            if not peer and not cand:
                continue
            ok = lambda r: r and not r.get("na") and r.get("ok")
            v = lambda r, k=m: r.get(k) if ok(r) else None
            out.append(f"{s:<10} {e:<28} {m:<9} {_f(er.get(m)):>9} {_f(v(peer)):>9} "
                       f"{_f(_ratio(er.get(m), v(peer), better), '{:.2f}'):>6} "
                       f"{_f(_ratio(er.get('p99_ms'), v(peer, 'p99_ms'), 'lower'), '{:.2f}'):>8} "
                       f"{_f(_ratio(er.get(m), v(cand), better), '{:.2f}'):>8} "
                       f"{_f(er.get('server_cpu_ms'), '{:.2f}'):>8} {_f(v(peer, 'server_cpu_ms'), '{:.2f}'):>8}")
    return out
