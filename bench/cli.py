"""``python -m bench``: run the scenarios side by side and report.

    python -m bench                     # quick profile (about 3 minutes), all targets
    python -m bench --profile full      # longer runs, concurrency sweep 1/4/16/32/64
    python -m bench --targets embedops-onnx,infinity --scenarios 1,2
    python -m bench --soak 600          # 10-minute RSS soak of the embedops server
    python -m bench --gpu               # the H200 profile (bench/gpu_check.sh runs it)
    python -m bench --operator --n 200,1000   # the operator at fleet scale (bench/operator_bench.py)
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from . import report
from .logs import log
from .loadgen import Request, run_load_sync, summarize
from .models import minilm_cross_encoder, minilm_dir
from .textgen import TextGen, load_tokenizer
from . import workloads as W

ALL_TARGETS = ["embedops-onnx", "embedops-onnx+quantize=int8", "embedops-torch", "infinity", "naive",
               "tei", "tei+int8", "tei-candle"]  # TEI: skipped in one line when not built (bench/tei.py)
RESULTS = Path(__file__).resolve().parent / "results"


def machine_state() -> dict:
    import os

    try:
        load = os.getloadavg()
    except OSError:
        load = (0, 0, 0)
    try:
        import psutil

        mem = psutil.virtual_memory()._asdict()
        top = sorted(((p.info["cpu_percent"] or 0, p.info["name"]) for p in
                      psutil.process_iter(["cpu_percent", "name"])), reverse=True)
    except Exception:
        mem, top = {}, []
    return {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
            "cpus": len(os.sched_getaffinity(0)), "cpu_model": _cpu_model(), "loadavg": load,
            "mem_total_gb": round(mem.get("total", 0) / 2**30, 1), "python": platform.python_version()}


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class Runner:
    def __init__(self, args):
        self.args = args
        self.profile = W.customize(W.PROFILES[args.profile], concurrencies=args.concurrency,
                                   duration_s=args.duration)
        self.rows: list[dict] = []
        self.errors: dict[str, str] = {}
        self.targets: dict = {}
        self.model_dir = Path(args.model_id) if args.model_id else minilm_dir()
        self.tok = load_tokenizer(self.model_dir)
        self.gen = TextGen(self.tok, seed=args.seed)
        self.w = W.build(self.gen, self.profile)
        self.out = Path(args.out)
        self.logs = self.out / "logs"
        self.rerank_dir = None
        self.rss: dict[str, dict] = {}
        self.meta: dict = {}
        self.round = 0

    # ------------------------------------------------------------------ servers
    def start_targets(self, names: list[str], rerank: bool) -> None:
        from .targets import embedops_target, infinity_target, naive_target
        from .tei import is_tei, tei_target

        pending = []
        for name in names:
            try:
                if name.startswith("embedops-"):
                    backend = name.split("+")[0].split("-", 1)[1]
                    if rerank:
                        bname = self.args.onnx_backend_name if backend == "onnx" else backend
                        t = embedops_target(self.model_dir, bname,
                                            rerank_model=self.rerank_dir, log_dir=self.logs,
                                            name=name, extra_args=self.args.embedops_args)
                    else:
                        bname = self.args.onnx_backend_name if backend == "onnx" else backend
                        t = embedops_target(self.model_dir, bname, log_dir=self.logs, name=name,
                                            extra_args=self.args.embedops_args)
                elif is_tei(name):
                    t = tei_target(name, self.model_dir, rerank_model=self.rerank_dir if rerank else None,
                                   log_dir=self.logs)
                elif name == "infinity":
                    if name in self.targets:
                        continue
                    t = infinity_target(self.model_dir, rerank_model=self.rerank_dir, log_dir=self.logs)
                elif name == "naive":
                    if name in self.targets:
                        continue
                    t = naive_target(self.model_dir, rerank_model=self.rerank_dir, log_dir=self.logs)
                else:
                    raise ValueError(f"unknown target {name}")
                log(f"starting {t.name}: {' '.join(t.server.argv)}")
                pending.append((name, t))
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
                log(f"{name} could not start: {msg[:2000]}")
                self.errors[name + ("/rerank" if rerank else "")] = msg[:4000]
        # start them side by side (startup is mostly waiting on imports and model loading)
        from concurrent.futures import ThreadPoolExecutor

        def start(item):
            name, t = item
            try:
                t.server.start()
                return name, t, None
            except Exception as e:
                return name, t, f"{type(e).__name__}: {e}"

        with ThreadPoolExecutor(max(1, len(pending))) as ex:
            for name, t, err in ex.map(start, pending):
                if err:
                    log(f"{name} could not start: {err[:2000]}")
                    self.errors[name + ("/rerank" if rerank else "")] = err[:4000]
                    continue
                log(f"{t.name} up in {t.server.startup_s:.1f}s, RSS {t.server.rss_mb():.0f} MB")
                self.targets[t.name + ("/rerank" if rerank and (name.startswith("embedops") or is_tei(name)) else "")] = t
                self.meta.setdefault("startup_s", {})[t.name] = round(t.server.startup_s, 2)

    def stop_target(self, key: str) -> None:
        t = self.targets.pop(key, None)
        if t:
            self.record_rss(t, key)
            t.server.stop()

    def record_rss(self, t, key: str | None = None) -> None:
        cur = self.rss.setdefault(key or t.name, {"peak_rss_mb": 0.0})
        cur["peak_rss_mb"] = max(cur["peak_rss_mb"], round(t.server.peak_rss_mb(), 1))
        cur["rss_now_mb"] = round(t.server.rss_mb(), 1)
        gpu = report.gpu_memory_from_metrics(t.server.get("/metrics"), t.server.get("/info"))
        if gpu is not None:
            cur["gpu_mem_mb"] = gpu

    def http_targets(self, rerank: bool = False):
        keys = [k for k in self.targets if k.endswith("/rerank") == rerank
                or (rerank and k in ("infinity", "naive-encode"))]
        if rerank:
            keys = [k for k in keys if self.targets[k].rerank_url]
        # interleave: rotate the order every scenario so no target always runs first/last
        r = len(self.rows) % max(1, len(keys))
        return [(k, self.targets[k]) for k in keys[r:] + keys[:r]]

    # ------------------------------------------------------------------ helpers
    def add(self, scenario: str, target: str, kind: str, concurrency: int | None, stats: dict, **extra):
        row = {"scenario": scenario, "target": target, "kind": kind, "concurrency": concurrency,
               **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.items()}, **extra}
        row["round"] = self.round
        self.rows.append(row)
        p = lambda k: row.get(k, float("nan"))
        log(f"  {scenario:<10} {target:<28} c={concurrency!s:<3} p50={p('p50_ms'):.1f}ms "
            f"p99={p('p99_ms'):.1f}ms req/s={p('req_s'):.1f} texts/s={p('texts_s'):.1f} "
            f"tok/s={p('tokens_s'):.0f} err={row.get('errors', 0)}"
            + (f" batch={row['avg_batch']:.1f}" if "avg_batch" in row else "")
            + (f" cpu/req={row['server_cpu_ms']:.2f}ms+client {row['client_cpu_ms']:.2f}ms"
               if "server_cpu_ms" in row else "")
            + (" srv=" + ",".join(f"{k}:{v:.1f}" for k, v in row["server_p50_ms"].items())
               if row.get("server_p50_ms") else "")
            + (f" [{row['config']}]" if row.get("config") else ""))

    def http(self, scenario: str, key: str, t, reqs: list[Request], concurrency: int, *,
             url: str, check, duration_s: float, max_requests: int, warmup: int | None = None):
        before = report.batch_counters(t.server.get("/metrics")) if key.startswith(("embedops", "tei")) else None
        warmup = concurrency if warmup is None else warmup
        server_cpu, client_cpu = t.server.cpu_s(), time.process_time()
        samples, wall = run_load_sync(url, reqs, concurrency=concurrency, max_requests=max_requests,
                                      duration_s=duration_s, check=check, warmup=warmup,
                                      request_timeout_s=120, drain_s=120)
        server_cpu, client_cpu = t.server.cpu_s() - server_cpu, time.process_time() - client_cpu
        st = summarize(samples, wall)
        extra = {}
        sent = len(samples) + warmup
        if sent and server_cpu > 0:  # CPU per request, warm-up included: what each side spends on one answer
            extra = {"server_cpu_ms": server_cpu * 1000 / sent, "client_cpu_ms": client_cpu * 1000 / sent}
        if before is not None:  # the server's own view: inputs and real tokens per formed batch
            after = report.batch_counters(t.server.get("/metrics"))
            if after and before and after["batches"] > before["batches"]:
                nb = after["batches"] - before["batches"]
                extra.update(avg_batch=(after["inputs"] - before["inputs"]) / nb,
                             avg_batch_tokens=(after["tokens"] - before["tokens"]) / nb)
        self.add(scenario, key, "http", concurrency, st.as_dict(), **extra)
        self.record_rss(t, key)
        return st

    def ceilings(self):
        """Raw forwards of the embedding model: ONNX Runtime sessions at each thread setting, one torch model."""
        if not hasattr(self, "_ceil"):
            from .ceiling import STEncode, Tokenize, server_onnx_file
            from .models import minilm_onnx_file

            onnx = server_onnx_file(self.model_dir) or minilm_onnx_file()
            self.meta["ceiling_onnx_file"] = str(onnx)
            self._ceil = self._forwards(onnx, self.model_dir, rerank=False)
            self._ceil["tokenize"] = Tokenize(self.tok)
            self._ceil["st"] = STEncode(self.model_dir)
        return self._ceil

    def _forwards(self, onnx, model_dir, *, rerank: bool) -> dict:
        from .ceiling import Configured, OrtForward, TorchForward, n_threads

        n = n_threads()
        cfgs = ([{"threads": n}, {"threads": n, "spinning": False}, {"threads": 1},
                 {"threads": max(1, n // 2), "spinning": False, "split": 2}] if n > 1 else [{"threads": 1}])
        out = {"onnx_cfgs": [(c, OrtForward(onnx, **c)) for c in cfgs] if onnx else []}
        t = TorchForward(model_dir, rerank=rerank)
        out["torch_cfgs"] = [({"threads": k}, Configured(t, k)) for k in sorted({n, 1}, reverse=True)]
        return out

    def pick(self, fwd: dict, tokenize, probes, scenario: str) -> dict:
        """Per scenario, the fastest thread setting of each backend on probes of that scenario's shape.

        On a shared, oversubscribed CPU, N threads can be many times slower than one for small batches
        (a barrier waits for a descheduled thread) and faster for big ones, so the ceiling is the best
        setting for the batch composition at hand, measured now."""
        from .ceiling import calibrate

        out = {}
        for b in ("onnx", "torch"):
            cfgs = fwd.get(f"{b}_cfgs") or []
            if not cfgs:
                continue
            if len(cfgs) == 1:
                out[b] = cfgs[0][1]
                continue
            f, cfg, timings = calibrate(lambda c, d=dict((str(k), v) for k, v in cfgs): d[str(c)],
                                        [c for c, _ in cfgs], tokenize, probes, rounds=1)
            out[b] = f
            self.meta.setdefault("ceiling_threads", {})[f"{scenario}/{b}"] = {"best": cfg, "s": timings}
        log(f"  ceiling settings for {scenario}: " + ", ".join(
            f"{b} {self.meta.get('ceiling_threads', {}).get(f'{scenario}/{b}', {}).get('best')}" for b in out))
        return out

    def ceiling(self, scenario: str, batches, counts, *, label: str, both: bool = True,
                backends=("onnx", "torch"), st: bool = True, budget: float | None = None,
                forwards=None, tokenize=None, max_iters: int = 10_000, probes=None):
        from .ceiling import time_batches, time_st

        if self.args.no_ceilings:
            return
        c = forwards or self.ceilings()
        tokenize = tokenize or c["tokenize"]
        budget = budget or self.profile.ceiling_budget_s
        probes = probes or [batches[0]]
        chosen = self.pick(c, tokenize, probes, scenario)
        for b in backends:
            if b not in chosen:
                continue
            for inc in ((True, False) if both else (True,)):
                r = time_batches(chosen[b], tokenize, batches, counts, include_tokenization=inc, budget_s=budget,
                                 max_iters=max_iters)
                name = f"ceiling-{b}" + ("" if inc else "-notok")
                self.add(scenario, name, "ceiling", None, r.as_dict(), batch=label,
                         config=getattr(chosen[b], "config", ""))
        if st and "st" in c:
            c["st"].threads = getattr(chosen.get("torch"), "threads", c["st"].threads)
            r = time_st(c["st"], batches, counts, budget, max_iters=max_iters)
            self.add(scenario, "inline-encode", "inline", None, r.as_dict(), batch=label)

    # ------------------------------------------------------------------ scenarios
    def s1(self):
        log("scenario 1: online, one short query at a time (concurrency 1)")
        w, P = self.w, self.profile
        self.ceiling("1-online", [[q] for q in w.short_queries], w.counts["short_queries"], label="1x16",
                     probes=[[q] for q in w.short_queries[:10]])
        for key, t in self.http_targets():
            reqs = [Request(t.embed_body([q]), 1, n) for q, n in zip(w.short_queries, w.counts["short_queries"])]
            self.http("1-online", key, t, reqs, 1, url=t.embed_url, check=t.embed_check,
                      duration_s=P.duration_s, max_requests=min(P.max_requests, 400), warmup=5)

    def s2(self):
        w, P = self.w, self.profile
        texts, counts = w.single_texts, w.counts["single_texts"]
        for c in P.concurrencies:
            log(f"scenario 2: single texts, concurrency {c}")
            bs = min(c, 64)
            batches = [texts[i:i + bs] for i in range(0, len(texts) - bs + 1, bs)]
            self.ceiling(f"2-c{c}", batches, [sum(counts[i:i + bs]) for i in range(0, len(texts) - bs + 1, bs)],
                         label=f"{bs}x32", both=P.both_tokenization or c == P.concurrencies[0])
            for key, t in self.http_targets():
                reqs = [Request(t.embed_body([x]), 1, n) for x, n in zip(texts, counts)]
                self.http(f"2-c{c}", key, t, reqs, c, url=t.embed_url, check=t.embed_check,
                          duration_s=P.duration_s, max_requests=P.max_requests)

    def s3(self):
        log("scenario 3: ingestion, 32 texts x 256 tokens per request, saturated")
        w, P = self.w, self.profile
        self.ceiling("3-ingest", w.ingest_batches, w.counts["ingest_batches"], label="32x256",
                     both=P.both_tokenization, max_iters=P.heavy_ceiling_iters, probes=[w.ingest_batches[0][:8]])
        for key, t in self.http_targets():
            reqs = [Request(t.embed_body(b), len(b), n) for b, n in zip(w.ingest_batches, w.counts["ingest_batches"])]
            self.http("3-ingest", key, t, reqs, 2, url=t.embed_url, check=t.embed_check,
                      duration_s=120, max_requests=P.ingest_requests, warmup=P.heavy_warmup)

    def s4(self):
        log("scenario 4: rerank, a query with 50 passages of 256 tokens")
        w, P = self.w, self.profile
        from .ceiling import OrtForward, Tokenize, TorchForward, server_onnx_file  # noqa: F401

        pair_tok = w.counts["rerank_pair_tokens"]
        batches = [[(w.rerank_query, p) for p in ps] for ps in w.rerank_passages]
        counts = [pair_tok * len(ps) for ps in w.rerank_passages]
        real = [sum(len(e.ids) for e in self.tok.encode_batch(b)) for b in batches]
        self.meta["rerank_pair_tokens"] = {"expected": counts, "measured": real}
        try:
            onnx = server_onnx_file(self.rerank_dir)
            f = self._forwards(onnx, self.rerank_dir, rerank=True)
            f["tokenize"] = Tokenize(self.tok, pairs=True)
            from .ceiling import STEncode

            f["st"] = STEncode(self.rerank_dir, rerank=True)
            self.ceiling("4-rerank", batches, real, label="50x287", both=P.both_tokenization,
                         forwards=f, max_iters=P.heavy_ceiling_iters, probes=[batches[0][:12]])
        except Exception as e:
            self.errors["4-rerank ceiling"] = f"{type(e).__name__}: {e}"
            log("rerank ceiling failed:", e)
        from .tei import is_tei, na_reason

        tei = [n for n in self.args.targets if is_tei(n) and n in self.targets]
        self.start_targets([n for n in self.args.targets if n.startswith("embedops-")]
                           + [n for n in tei if "int8" not in n], rerank=True)
        int8_up = any("int8" in k for k in self.targets if k.endswith("/rerank"))
        self.start_targets([n for n in tei if "int8" in n and int8_up], rerank=True)  # like for like only
        for n in [n for n in tei if "int8" in n and not int8_up]:
            self.rows.append({"scenario": "4-rerank", "target": n, "kind": "http", "na": na_reason(n, "4-rerank")})
        for key, t in self.http_targets(rerank=True):
            reqs = [Request(t.rerank_body(w.rerank_query, ps), len(ps), n) for ps, n in zip(w.rerank_passages, real)]
            self.http("4-rerank", key, t, reqs, 1, url=t.rerank_url, check=t.rerank_check,
                      duration_s=120, max_requests=P.rerank_requests, warmup=P.heavy_warmup)
        for key in [k for k in self.targets if k.endswith("/rerank")]:
            self.stop_target(key)
        for key in self.args.targets:
            if key not in ("infinity", "naive") and not any(
                    r["target"].split("/")[0] == key and r["scenario"] == "4-rerank" for r in self.rows):
                if key.startswith("embedops-torch") or key in tei:
                    self.rows.append({"scenario": "4-rerank", "target": key, "kind": "http", "na":
                                      "rerank server failed to start or answer"})

    def s5(self):
        log("scenario 5: mixed lengths 16-512 tokens, single texts from 32 clients")
        w, P = self.w, self.profile
        texts, counts = w.mixed_texts, w.counts["mixed_texts"]
        mean = round(sum(counts) / len(counts))
        uni = [self.gen.texts(32, mean) for _ in range(3)]
        # uniform-length ceiling at the mean length (same tokens per batch, no padding)
        self.ceiling("5-mixed", uni, [32 * mean] * len(uni), label=f"32x{mean} uniform", both=False,
                     st=False, max_iters=P.heavy_ceiling_iters + 1, probes=[uni[0][:8]])
        for r in self.rows[-2:]:
            r["target"] += "-uniform"
        if P.both_tokenization:  # full profile: the same mixed texts in arrival order, padded to the longest
            mixed = [texts[i:i + 32] for i in range(0, 32 * 3, 32)]  # (what FIFO batching would pay)
            self.ceiling("5-mixed", mixed, [sum(counts[i:i + 32]) for i in range(0, 96, 32)],
                         label="32 mixed padded", both=False, st=False, max_iters=P.heavy_ceiling_iters + 1,
                         probes=[uni[0][:8]])
            for r in self.rows[-2:]:
                r["target"] += "-mixedpad"
        for key, t in self.http_targets():
            reqs = [Request(t.embed_body([x]), 1, n) for x, n in zip(texts, counts)]
            self.http("5-mixed", key, t, reqs, W.MIXED_CLIENTS, url=t.embed_url, check=t.embed_check,
                      duration_s=P.mixed_duration_s, max_requests=P.max_requests, warmup=4)

    # ------------------------------------------------------------------ main
    def run(self) -> dict:
        t0 = time.time()
        self.meta.update(machine_before=machine_state(), profile=self.profile.__dict__,
                         model=str(self.model_dir), seed=self.args.seed, argv=sys.argv[1:])
        scen = set(self.args.scenarios)
        if 4 in scen:
            self.rerank_dir = minilm_cross_encoder()
        self.start_targets([n for n in self.args.targets], rerank=False)
        try:
            for i, fn in ((1, self.s1), (2, self.s2), (3, self.s3), (4, self.s4), (5, self.s5)):
                if i not in scen:
                    continue
                # rounds: ceiling and targets again, in rotated order; the report takes medians
                for self.round in range(self.args.rounds if i in (1, 2) else 1):
                    try:
                        fn()
                    except Exception as e:
                        import traceback

                        traceback.print_exc()
                        self.errors[f"scenario {i}"] = f"{type(e).__name__}: {e}"
        finally:
            for key in list(self.targets):
                self.stop_target(key)
        self.meta.update(machine_after=machine_state(), total_s=round(time.time() - t0, 1),
                         rounds=self.args.rounds)
        return {"meta": self.meta, "rows": report.median_rows(self.rows), "raw_rows": self.rows,
                "rss": self.rss, "errors": self.errors}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--operator" in argv:  # its own scenario and options
        from .operator_bench import main as operator_main

        return operator_main([a for a in argv if a != "--operator"])
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(W.PROFILES), default="quick")
    ap.add_argument("--quick", action="store_const", const="quick", dest="profile")
    ap.add_argument("--full", action="store_const", const="full", dest="profile")
    ap.add_argument("--targets", default=",".join(ALL_TARGETS),
                    help=f"comma list of {ALL_TARGETS} (ceilings and inline encode always run)")
    ap.add_argument("--scenarios", default="1,2,3,4,5")
    ap.add_argument("--model-id", help="embedding model folder (default: bundled all-MiniLM-L6-v2)")
    ap.add_argument("--onnx-backend-name", default="onnx", help="embedops --backend value for ONNX Runtime")
    ap.add_argument("--embedops-arg", action="append", dest="embedops_args", default=[],
                    help="extra argument for embedops-server (repeatable)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--concurrency", help="scenario 2's concurrency sweep instead of the profile's, e.g. 16,64")
    ap.add_argument("--duration", type=float, help="seconds per closed-loop run instead of the profile's")
    ap.add_argument("--no-ceilings", action="store_true",
                    help="skip the raw-forward ceilings and inline encode (servers side by side only)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="repeat scenarios 1-2 (ceiling and every target, rotated) and report medians "
                         "(default: 1 quick, 3 full)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--soak", type=float, metavar="SECONDS", help="RSS soak of embedops instead of scenarios")
    ap.add_argument("--pyspy", action="store_true",
                    help="profile the embedops server with py-spy during scenario 1 and 2 (writes top frames)")
    ap.add_argument("--gpu", action="store_true", help="the CUDA profile (see bench/gpu.py)")
    ap.add_argument("--build-tei", action="store_true",
                    help="build TEI with the kit first when it is not built (cached; see bench/tei.py)")
    args = ap.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    if args.rounds is None:
        args.rounds = 3 if args.profile == "full" else 1
    args.scenarios = [int(s) for s in args.scenarios.split(",") if s]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c] if args.concurrency else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if args.build_tei:
        from .tei import build, unavailable_reason

        if unavailable_reason():
            try:
                build(log=log)
            except Exception as e:  # the TEI targets are then skipped in one line each
                log(f"TEI build failed: {type(e).__name__}: {str(e)[:500]}")

    if args.gpu:
        from .gpu import run_gpu

        res = run_gpu(args)
        name = f"gpu-{stamp}.json"
    elif args.soak:
        from .soak import run_soak

        res = run_soak(args)
        name = f"soak-{stamp}.json"
    else:
        runner = Runner(args)
        if args.pyspy:
            from .profile import attach_pyspy

            attach_pyspy(runner)
        res = runner.run()
        name = f"bench-{stamp}.json"
        print(report.table(res))
        if not args.no_plots:
            for p in report.plots(res, out, stamp):
                log("plot:", p)
    (out / name).write_text(json.dumps(res, indent=1, default=str))
    latest = "latest.json" if name.startswith("bench-") else name.split("-")[0] + "-latest.json"
    (out / latest).write_text(json.dumps(res, indent=1, default=str))
    log("results:", out / name)
    return 0
