"""Prometheus metrics with TEI's `te_*` names (so TEI dashboards work), plus HELP lines TEI lacks.

Counters are exported under their exact TEI names (no `_total` suffix, which prometheus-client would add).
"""
from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, disable_created_metrics, Gauge, Histogram, generate_latest

from ..core.lanes import LANES

disable_created_metrics()  # TEI exports no *_created series

# Every value te_request_failure's `err` label takes (router/errors.py, router/state.py). Exported at 0 from
# the start: a series that appears only with the first failure makes rate() and ratios over it "no data"
# instead of 0 (the dashboard's 429 share panel was empty on a healthy service, found on a live Prometheus).
FAILURE_CAUSES = ("validation", "tokenization", "batch_size", "model_type", "overloaded", "inference",
                  "unhealthy", "dropped")
METHODS = ("single", "batch")

# TEI's duration buckets: 35 geometric buckets from 15 us, x1.5 each.
DURATION_BUCKETS = [1.5e-5 * 1.5 ** i for i in range(35)]


def after_response(record, *args) -> None:
    """Run `record(*args)` (a request's metrics) after its answer is written rather than before: a callback the
    event loop runs once the current task step ends (the step that sends the answer awaits nothing once the
    result is in) and before it reads the next request, so a scrape that follows an answer counts it. Some
    25 us of histogram and counter updates off a lone query's latency (docs/benchmarks/2026-12-06-lone-query.md)."""
    asyncio.get_running_loop().call_soon(record, *args)


class _Counters:
    """Labelled counters with exact names; one lock, a dict increment per observation."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[tuple, float] = defaultdict(float)
        self._help: dict[str, tuple[str, tuple[str, ...]]] = {}

    def declare(self, name: str, help_: str, labels: tuple[str, ...] = ()) -> None:
        self._help[name] = (help_, labels)

    def zero(self, name: str, **labels) -> None:
        """Export this label set at 0 until it is first counted."""
        with self._lock:
            self._values.setdefault((name, tuple(sorted(labels.items()))), 0.0)

    def set(self, name: str, value: float, **labels) -> None:
        """A counter kept elsewhere (the answer cache's), copied at scrape time."""
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = value

    def inc(self, name: str, amount: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] += amount

    def render(self) -> str:
        """Text exposition written here: prometheus-client would rename counters to `<name>_total`."""
        with self._lock:
            items = sorted(self._values.items())
        by_name: dict[str, list] = defaultdict(list)
        for (name, labels), v in items:
            by_name[name].append((labels, v))
        lines = []
        for name, (help_, _) in self._help.items():
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} counter")
            for labels, v in by_name.get(name) or [((), 0.0)]:
                lab = ",".join(f'{k}="{val}"' for k, val in labels)
                lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")
        return "\n".join(lines) + "\n"


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.c = _Counters()
        for name, help_ in [
            ("te_request_count", "Requests received, by method (single or batch)"),
            ("te_request_success", "Requests answered successfully, by method"),
            ("te_request_failure", "Failed requests, by cause (err)"),
            ("te_embed_count", "Inputs received by the embed routes"),
            ("te_embed_success", "Inputs embedded successfully"),
            ("te_predict_count", "Inputs received by the predict and rerank routes"),
            ("te_predict_success", "Predict and rerank inputs scored successfully"),
            ("te_queue_dropped_inputs", "Queued inputs dropped because their client went away (embedops)"),
        ]:
            self.c.declare(name, help_)
        for err in FAILURE_CAUSES:
            self.c.zero("te_request_failure", err=err)
        for method in METHODS:
            self.c.zero("te_request_count", method=method)
            self.c.zero("te_request_success", method=method)
        r = self.registry

        def hist(name, help_, buckets=DURATION_BUCKETS):
            return Histogram(name, help_, registry=r, buckets=buckets)

        self.request_duration = hist("te_request_duration", "End-to-end request duration in seconds")
        self.request_tok = hist("te_request_tokenization_duration", "Tokenization time per request (s)")
        self.request_queue = hist("te_request_queue_duration", "Queue time per request, per-input average (s)")
        self.request_inf = hist("te_request_inference_duration", "Inference time per request, per-input average (s)")
        self.embed_duration = hist("te_embed_duration", "End-to-end embed duration per request (s)")
        self.predict_duration = hist("te_predict_duration", "End-to-end predict/rerank duration per request (s)")
        self.input_length = Histogram("te_request_input_length", "Tokens per input", registry=r,
                                      buckets=[2 ** i for i in range(0, 16)])
        self.batch_size = Histogram("te_batch_next_size", "Inputs per formed batch", registry=r,
                                    buckets=[2 ** i for i in range(0, 13)])
        self.batch_tokens = Histogram("te_batch_next_tokens", "Real (unpadded) tokens per formed batch",
                                      registry=r, buckets=[2 ** i for i in range(0, 21)])
        self.queue_size = Gauge("te_queue_size", "Inputs waiting in the batch queue", registry=r)
        self.in_flight = Gauge("te_in_flight_inputs", "Admitted inputs not yet answered (embedops addition)",
                               registry=r)

        # Per lane (core/lanes.py): the te_* series above are totals, as in TEI (a query over them keeps working)
        self.c.declare("embedops_lane_requests", "Requests answered, by lane (embedops addition)",
                       ("lane",))
        self.c.declare("embedops_lane_overloaded",
                       "Requests refused with 429 by lane: the batch lane is refused first (embedops addition)",
                       ("lane",))
        for lane in LANES:
            self.c.zero("embedops_lane_requests", lane=lane)
            self.c.zero("embedops_lane_overloaded", lane=lane)
        self.lane_duration = Histogram("embedops_lane_request_duration",
                                       "Time from a request's submission to the engine to its answer (s), by "
                                       "lane (embedops addition)", ["lane"], registry=r, buckets=DURATION_BUCKETS)
        self.lane_queue = Gauge("embedops_lane_queue_size", "Inputs waiting in a lane's queue (embedops addition)",
                                ["lane"], registry=r)
        self.lane_in_flight = Gauge("embedops_lane_in_flight_inputs",
                                    "Admitted inputs not yet answered, by lane (embedops addition)", ["lane"],
                                    registry=r)
        # each lane's child made once: `labels()` takes a lock and a dict lookup on every request otherwise
        self.lane_duration_of = {lane: self.lane_duration.labels(lane=lane) for lane in LANES}
        for lane in LANES:
            self.lane_queue.labels(lane=lane).set(0)
            self.lane_in_flight.labels(lane=lane).set(0)

        # The answer cache (--answer-cache-bytes, core/cache.py): exported only when it is on
        self._cache_declared = False
        self.cache_bytes = Gauge("embedops_answer_cache_bytes", "Bytes the answer cache holds (its vectors, keys "
                                 "and per-entry overhead) (embedops addition)", registry=None)
        self.cache_entries = Gauge("embedops_answer_cache_entries", "Answers the answer cache holds (embedops "
                                   "addition)", registry=None)

        # Only exported when the backend runs on a GPU (torch on CUDA): set from the backend on each scrape.
        self.gpu_memory = Gauge("embedops_gpu_memory_bytes",
                                "GPU memory of this process by kind: allocated (tensors now), reserved (the "
                                "caching allocator's pool), max_allocated (peak since start) (embedops addition)",
                                ["kind"], registry=r)

    def update_lanes(self, lanes) -> None:
        """Per-lane gauges at scrape time (lanes off: every queued input counts as batch)."""
        for lane in LANES:
            self.lane_queue.labels(lane=lane).set(lanes.queued(lane))
            self.lane_in_flight.labels(lane=lane).set(lanes.in_flight_of(lane))

    def update_cache(self, cache) -> None:
        """The answer cache's counters and size at scrape time (None: off, nothing exported)."""
        if cache is None:
            return
        if not self._cache_declared:
            self._cache_declared = True
            for name, help_ in [
                    ("embedops_answer_cache_hits", "Inputs answered from the answer cache (embedops addition)"),
                    ("embedops_answer_cache_misses", "Cacheable inputs the answer cache did not hold: computed, "
                                                     "then kept (embedops addition)"),
                    ("embedops_answer_cache_evictions", "Answers dropped from the answer cache to stay within its "
                                                        "bytes, least recently used first (embedops addition)")]:
                self.c.declare(name, help_)
            self.registry.register(self.cache_bytes)
            self.registry.register(self.cache_entries)
        self.c.set("embedops_answer_cache_hits", cache.hits)
        self.c.set("embedops_answer_cache_misses", cache.misses)
        self.c.set("embedops_answer_cache_evictions", cache.evictions)
        self.cache_bytes.set(cache.bytes)
        self.cache_entries.set(len(cache))

    def update_gpu(self, stats: dict | None) -> None:
        if not stats:
            return
        for kind, v in stats.items():
            self.gpu_memory.labels(kind=kind).set(v)

    def render(self) -> bytes:
        return self.c.render().encode() + generate_latest(self.registry)
