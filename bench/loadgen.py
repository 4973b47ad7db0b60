"""Asyncio HTTP load generator: closed loop (N workers) or open loop (Poisson arrivals), always bounded.

Every run stops by itself: after ``max_requests`` requests have been sent or ``duration_s`` has passed,
whichever comes first, and in-flight requests are then given ``drain_s`` to finish (after that they are
cancelled and counted as errors). Loopback only: the URL is checked.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import aiohttp

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Request:
    """One request to send: a JSON body, and the number of texts/tokens it carries (for throughput)."""
    body: Any
    n_texts: int = 1
    n_tokens: int = 0


@dataclass
class Sample:
    start: float
    latency: float
    ok: bool
    status: int
    n_texts: int
    n_tokens: int
    error: str = ""
    server_ms: dict | None = None  # TEI timing headers (x-total-time, x-queue-time ...), when sent
    retry_after: float = 0.0  # a 429's Retry-After, seconds


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) without numpy; nan for an empty list."""
    if not values:
        return math.nan
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class RunStats:
    requests: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict = field(default_factory=dict)
    wall_s: float = 0.0
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p99_ms: float = math.nan
    mean_ms: float = math.nan
    req_s: float = 0.0
    texts_s: float = 0.0
    tokens_s: float = 0.0
    server_p50_ms: dict = field(default_factory=dict)  # medians of the server's timing headers
    # embedops' Server-Timing stages (ms, means) of the slowest 1% of requests and of the middle 10% (p45-p55),
    # with "client" = client latency - the server's total (HTTP server, socket, the load generator): which stage
    # the tail comes from. Empty for servers that do not send the header.
    tail_ms: dict = field(default_factory=dict)
    median_ms: dict = field(default_factory=dict)
    tail_n: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def summarize(samples: Sequence[Sample], wall_s: float | None = None) -> RunStats:
    """Latency percentiles over successful requests; throughput = successful work / wall time.

    The wall time is from the first request's start to the last completion unless given.
    """
    st = RunStats(requests=len(samples))
    good = [s for s in samples if s.ok]
    st.ok = len(good)
    st.errors = len(samples) - len(good)
    for s in samples:
        if not s.ok:
            key = str(s.status) if s.status else (s.error.split(":")[0] or "error")
            st.error_kinds[key] = st.error_kinds.get(key, 0) + 1
    if not samples:
        return st
    if wall_s is None:
        wall_s = max(s.start + s.latency for s in samples) - min(s.start for s in samples)
    st.wall_s = wall_s
    if good:
        lat = [s.latency * 1000 for s in good]
        st.p50_ms = percentile(lat, 50)
        st.p90_ms = percentile(lat, 90)
        st.p99_ms = percentile(lat, 99)
        st.mean_ms = sum(lat) / len(lat)
        heads = [s.server_ms for s in good if s.server_ms]
        if heads:
            for k in heads[0]:
                if k in TIMING_KEYS:
                    st.server_p50_ms[k] = percentile([h[k] for h in heads if k in h], 50)
        st.tail_ms, st.median_ms, st.tail_n = tail_breakdown(good)
    if wall_s > 0:
        st.req_s = len(good) / wall_s
        st.texts_s = sum(s.n_texts for s in good) / wall_s
        st.tokens_s = sum(s.n_tokens for s in good) / wall_s
    return st


def _mean_stages(rows: Sequence[Sample]) -> dict:
    """Mean stages of samples that all carry Server-Timing (tail_breakdown picks them)."""
    out = {}
    for k in STAGES + ("total", "batch"):
        vals = [s.server_ms.get("st_" + k, 0.0) for s in rows]
        out[k] = sum(vals) / len(vals)
    out["client"] = sum(s.latency * 1000 - s.server_ms["st_total"] for s in rows) / len(rows)
    out["beside"] = sum(s.server_ms.get("st_beside", 0.0) for s in rows) / len(rows)
    out["latency"] = sum(s.latency * 1000 for s in rows) / len(rows)
    return out


def tail_breakdown(good: Sequence[Sample]) -> tuple[dict, dict, int]:
    """Mean Server-Timing stages of the slowest 1% (at least one request) and of the p45-p55 band."""
    timed = sorted((s for s in good if s.server_ms and "st_total" in s.server_ms), key=lambda s: s.latency)
    if len(timed) < 20:
        return {}, {}, 0
    n = len(timed)
    k = max(1, n // 100)
    return _mean_stages(timed[-k:]), _mean_stages(timed[int(n * 0.45):int(n * 0.55)]), k  # n >= 20: band not empty


def parse_server_timing(value: str) -> dict:
    """`Server-Timing: parse;dur=0.1, ..., batch;desc=16` -> {"st_parse": 0.1, ..., "st_batch": 16.0}."""
    out = {}
    for part in value.split(","):
        name, _, params = part.strip().partition(";")
        for p in params.split(";"):
            key, _, v = p.strip().partition("=")
            if key in ("dur", "desc"):
                try:
                    out["st_" + name] = float(v.strip('"'))
                except ValueError:
                    pass
    return out


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"load generator is loopback-only, refusing {url!r}")


TIMING_HEADERS = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")
TIMING_KEYS = tuple(h[2:-5] for h in TIMING_HEADERS)
STAGES = ("parse", "tokenize", "queue", "slot", "forward", "wake", "respond")  # embedops' Server-Timing
CHECK_EVERY = 10  # parse and check 1 response body in 10 (and the first ones): JSON parsing of big
# embedding responses in the client would otherwise take CPU from the server on a small machine


async def _send(session: aiohttp.ClientSession, url: str, req: Request,
                check: Callable[[Any], bool] | None, timeout_s: float) -> Sample:
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=req.body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            payload = await r.read()
            lat = time.perf_counter() - t0
            ok = r.status == 200
            err = ""
            if ok and not payload:
                ok, err = False, "check:empty body"
            if ok and check is not None and _should_check():
                import json

                try:
                    ok = bool(check(json.loads(payload)))
                except Exception as e:  # malformed body counts as an error
                    ok, err = False, f"check:{e}"
                if not ok and not err:
                    err = "check:bad response"
            elif not ok:
                err = f"http:{r.status}"
            sm = None
            if "x-total-time" in r.headers:
                sm = {}
                for h in TIMING_HEADERS:
                    try:
                        sm[h[2:-5]] = float(r.headers[h])
                    except (KeyError, ValueError):
                        pass
                if "server-timing" in r.headers:
                    sm.update(parse_server_timing(r.headers["server-timing"]))
            wait = 0.0
            if r.status == 429:
                try:
                    wait = float(r.headers.get("retry-after", "0"))
                except ValueError:
                    pass
            return Sample(t0, lat, ok, r.status, req.n_texts, req.n_tokens, err, sm, wait)
    except asyncio.CancelledError:
        return Sample(t0, time.perf_counter() - t0, False, 0, req.n_texts, req.n_tokens, "cancelled")
    except Exception as e:
        return Sample(t0, time.perf_counter() - t0, False, 0, req.n_texts, req.n_tokens,
                      f"{type(e).__name__}:{e}")


async def run_load(
    url: str,
    requests: Sequence[Request],
    *,
    concurrency: int = 1,
    max_requests: int | None = None,
    duration_s: float = 10.0,
    rate: float | None = None,
    warmup: int = 0,
    check: Callable[[Any], bool] | None = None,
    request_timeout_s: float = 60.0,
    drain_s: float = 30.0,
    seed: int = 0,
    honor_retry_after: bool = False,
) -> tuple[list[Sample], float]:
    """Send ``requests`` (cycled) to ``url``.

    Closed loop when ``rate`` is None: ``concurrency`` workers each send the next request as soon as their
    previous one returns. Open loop otherwise: Poisson arrivals at ``rate`` requests/s, at most
    ``concurrency`` in flight (arrivals beyond that wait, and their queueing time counts in latency).
    ``warmup`` requests are sent first (closed loop, same concurrency) and not recorded.
    ``honor_retry_after`` (closed loop): a worker answered 429 waits its Retry-After before its next request, as
    the OpenAI SDK and other well-behaved clients do (the 429 still counts as an error).
    Returns the samples and the measured wall time.
    """
    check_loopback(url)
    if not requests:
        raise ValueError("no requests to send")
    max_requests = max_requests if max_requests is not None else 10**9
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=conn) as session:
        if warmup:
            it = iter(range(warmup))

            async def wworker():
                for i in it:
                    await _send(session, url, requests[i % len(requests)], None, request_timeout_s)

            await asyncio.gather(*(wworker() for _ in range(min(concurrency, warmup))))

        t_start = time.perf_counter()
        deadline = t_start + duration_s
        counter = iter(range(max_requests))

        if rate is None:
            async def worker():
                for i in counter:
                    if time.perf_counter() >= deadline:
                        return
                    sample = await _send(session, url, requests[i % len(requests)], check, request_timeout_s)
                    samples.append(sample)
                    if honor_retry_after and sample.retry_after:
                        await asyncio.sleep(min(sample.retry_after, max(0.0, deadline - time.perf_counter())))

            tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        else:
            sem = asyncio.Semaphore(concurrency)
            rng = random.Random(seed)

            async def one(i: int, t_arrival: float):
                async with sem:
                    s = await _send(session, url, requests[i % len(requests)], check, request_timeout_s)
                s.latency += s.start - t_arrival  # queueing before a free slot counts as latency
                s.start = t_arrival
                samples.append(s)

            async def arrivals():
                inner = []
                t = time.perf_counter()
                for i in counter:
                    t += rng.expovariate(rate)
                    now = time.perf_counter()
                    if t >= deadline:
                        break
                    if t > now:
                        await asyncio.sleep(t - now)
                    inner.append(asyncio.create_task(one(i, t)))
                await asyncio.gather(*inner)

            tasks = [asyncio.create_task(arrivals())]
        # bounded: stop at the deadline plus a drain period, whatever the server does
        done, pending = await asyncio.wait(tasks, timeout=duration_s + drain_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t_start
        if samples:
            wall = max(s.start + s.latency for s in samples) - t_start
    return samples, wall


_checked = [0]


def _should_check() -> bool:
    _checked[0] += 1
    return _checked[0] <= 5 or _checked[0] % CHECK_EVERY == 0


def run_load_sync(*args, **kwargs) -> tuple[list[Sample], float]:
    return asyncio.run(run_load(*args, **kwargs))
