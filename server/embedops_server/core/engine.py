"""The engine: admission, tokenization hand-off, a batcher thread and inference threads.

Event loop -> TokenizerPool (threads; a small request is encoded on the event loop itself) -> BatchQueue ->
batcher thread (forms the next batch and builds its padded arrays while the forwards run) -> inference threads
(backend forward + numpy post-processing) -> one call_soon_threadsafe per batch back to the event loop.

A lone small request (nothing else queued or running, within the backend's `inline_tokens`, and the caller knows
of no other request waiting: `alone`) is tokenized and run on the event loop's own thread instead, answered
before `submit` returns: no thread hop either way. `alone` matters under load: requests that arrived while an
inline forward blocked the loop are not queued yet, so without it each would find the engine idle and run
inline in turn, one row per forward for as long as the load lasts.

One inference thread by default. A backend may ask for more (`parallel_forwards`): small CPU models run two
forwards side by side, each on part of the cores, which beats one forward on all of them (no barrier between
threads per operator; measured in docs/bench.md). A forward that starts alone runs on every core, and with
`wide_alone` no second forward starts beside it until it ends: a narrow forward next to a wide one would put
more compute threads than cores on the machine, and the wide one's threads wait for each other at every
operator's barrier while one of them is off its core.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .batch import Batch, BatchOutput, multi_result, padded
from .cache import AnswerCache, Lookup
from .errors import BACKEND, VALIDATION, EngineError
from .queue import BatchQueue, Entry
from .tokenization import EncodeJob, TokenizerPool

log = logging.getLogger(__name__)

# Look-ahead top-up: when the inference thread picks up the look-ahead batch while inputs are still being
# tokenized (under concurrent load: the clients of the batch just answered sending their next texts), it waits
# for them, at most this long and at most LINGER_FRACTION of a recent forward, and only while the batch is
# under half its token budget. Never at concurrency 1 (no look-ahead batch exists there).
LINGER_MAX_S = 0.002
LINGER_FRACTION = 0.1
# An inline forward blocks the event loop (no request is parsed or answered meanwhile): only while forwards of
# that size take less than this (moving average over every forward within `inline_tokens`, inline or not).
INLINE_MAX_S = 0.005


def linger_s(forward_s: float, batch_tokens: int, budget_tokens: int, tokenizing: int) -> float:
    """How long to wait for inputs in tokenization before running a look-ahead batch (0: run now)."""
    if tokenizing <= 0 or batch_tokens * 2 >= budget_tokens or forward_s <= 0:
        return 0.0
    return min(LINGER_MAX_S, LINGER_FRACTION * forward_s)


class Request:
    """One HTTP request's worth of inputs travelling through the engine.

    Its timeline (perf_counter seconds; 0 until reached), which the router sends as `Server-Timing` so that a
    client or the bench can say which stage a slow request lost its time in: submitted (t_start) -> tokenized
    (t_tokenized) -> its last input taken into a batch (t_batched) -> first forward starts (t_forward) -> last
    forward ends (t_forwarded) -> the event loop resumes the handler (t_done)."""
    __slots__ = (
        "future", "loop", "n", "remaining", "results", "need_tokens", "cancelled", "done",
        "t_start", "t_tokenized", "t_queue", "t_infer", "tokens", "outputs",
        "t_batched", "t_forward", "t_forwarded", "t_done", "batch_rows", "beside", "lane", "cached",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int, need_tokens: bool,
                 outputs: tuple[str, ...] | None = None):
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.n = n
        self.remaining = n
        self.results: list[Any] = [None] * n
        self.need_tokens = need_tokens
        self.cancelled = False
        self.done = False
        self.t_start = time.perf_counter()
        self.t_tokenized = 0.0
        self.t_queue = 0.0  # summed over inputs (divided by n for the per-input average)
        self.t_infer = 0.0
        self.tokens = 0
        self.t_batched = self.t_forward = self.t_forwarded = self.t_done = 0.0
        self.batch_rows = 0  # inputs in the largest forward this request's inputs were part of
        self.beside = False  # one of its forwards ran beside another one (parallel_forwards)
        # multi-output request (bge-m3): each result is a dict of these outputs; None: the pooled vector
        self.outputs = outputs
        self.lane = ""  # the lane (core/lanes.py) whose engine runs it; "" without lanes
        self.cached: Lookup | None = None  # what the answer cache had: its computed answers join it when done


@dataclass
class EngineStats:
    """Hooks the router wires to Prometheus; core stays free of HTTP and metrics libraries."""
    on_batch: Callable[[int, int], None] = lambda size, tokens: None
    on_dropped: Callable[[int], None] = lambda n: None
    on_input_length: Callable[[int], None] = lambda n: None


class Engine:
    """``lane``, ``nice``, ``inline``, ``beside``: one lane of core/lanes.py (another engine shares the backend
    and the tokenizers): its name, the nice value its threads run at (0: unchanged), whether a lone query may run
    on the event loop, and a test of whether the other lane is busy now (this one's forwards then run narrow)."""

    def __init__(self, backend, tokenizers: TokenizerPool, max_input_length: int, max_batch_tokens: int,
                 max_batch_requests: int | None, max_concurrent_requests: int, stats: EngineStats | None = None,
                 forward_tokens: int | None = None, workers: int = 1, lane: str = "", nice: int = 0,
                 inline: bool = True, beside: Callable[[], bool] | None = None,
                 max_token_outputs: int | None = None, cache: AnswerCache | None = None):
        self.backend = backend
        self.cache = cache  # core/cache.py: one for every lane's engine (one space)
        # tokens a request answering every token's state (/embed_all: tokens x width floats) may hold (issue 53)
        self.max_token_outputs = max_token_outputs
        self.lane = lane
        self.nice = nice
        self._beside = beside or _never
        self.urgent_lane = ""  # one engine for both lanes: this lane's inputs head the next batch (queue.py)
        self.tokenizers = tokenizers
        self.max_input_length = max_input_length
        self.max_concurrent = max_concurrent_requests
        self.queue = BatchQueue(max_batch_tokens, max_batch_requests, forward_tokens)
        self.stats = stats or EngineStats()
        self.in_flight = 0  # admitted inputs not yet answered; touched only on the event loop
        # One batch of look-ahead: while every inference thread is busy, the batcher forms and pads the next
        # batch into this slot. An idle inference thread forms its own batch (one thread hop fewer at low
        # load). All coordinate on the queue's condition variable.
        self._cv = self.queue.cv
        self._slot: tuple | None = None
        self.workers = max(1, workers)
        self._running = 0  # forwards in progress (guarded by _cv)
        self._throughput = 0.0  # inputs/s, exponential moving average, for Retry-After
        self._forward_s = 0.0  # seconds per forward, exponential moving average (look-ahead linger)
        self._tokenizing = 0  # inputs submitted to the tokenizers and not yet queued (guarded by _cv)
        self.inline_tokens = getattr(backend, "inline_tokens", 0) if inline else 0
        self.wide_alone = self.workers > 1 and getattr(backend, "wide_alone", False)
        self._wide = False  # a forward on every core is running: no other starts (guarded by _cv)
        self._inline_s = 0.0  # seconds per forward within inline_tokens, moving average (0: none seen yet)
        self._stop = False
        suffix = f"-{lane}" if lane else ""
        self._threads = [threading.Thread(target=self._batcher, name="batcher" + suffix, daemon=True)] + [
            threading.Thread(target=self._inference, name=(f"inference-{i}" if i else "inference") + suffix,
                             daemon=True)
            for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def running(self) -> bool:
        """Does a forward of this engine run now (read without the lock: a hint for the other lane)?"""
        return self._running > 0

    # ---- event-loop side -------------------------------------------------------------------
    def hold(self, n: int) -> None:
        """Count `n` admitted inputs in (Retry-After and the other lane read the count). Admission, the limits and
        the 429, is the lanes' (core/lanes.py `Lanes.admit`): one place decides, whatever the engines."""
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n

    def retry_after(self) -> int:
        rate = self._throughput or 1.0
        return max(1, min(60, math.ceil(self.in_flight / rate)))

    def lookup(self, texts: Sequence, truncate: bool, direction: str, need_tokens: bool = False,
               outputs: Sequence[str] | None = None) -> Lookup | None:
        """What the answer cache holds for these inputs (None: no cache, or a request it does not keep: every
        token's state, multi-output). Pass it to `submit`, which computes only the rest; admit only those."""
        if self.cache is None or need_tokens or outputs:
            return None
        return self.cache.lookup(texts, truncate, direction)

    def submit(self, texts: Sequence, truncate: bool, direction: str, need_tokens: bool = False,
               outputs: Sequence[str] | None = None, alone: bool = True, lane: str = "",
               cached: Lookup | None = None) -> Request:
        """Queue admitted inputs; await `request.future`. Caller must have called hold(len(texts)), or hold of
        the inputs ``cached`` (this engine's `lookup`) misses: only those are computed, the others are answered from
        the cache (all of them: the future is done on return), and the computed ones join the cache when done.
        ``outputs``: a multi-output request (any of "dense", "sparse", "colbert", which the backend's model must
        have); each result is then a dict of those, all from one forward. ``alone``: the caller knows of no other
        request waiting to be submitted (False keeps this one's forward off the event loop). ``lane``: the lane of
        the request where one engine serves both (its inputs head the next batch when it is `urgent_lane`)."""
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()
        req = Request(loop, len(texts), need_tokens, tuple(outputs) if outputs else None)
        req.lane = lane or self.lane
        urgent = bool(self.urgent_lane) and req.lane == self.urgent_lane
        index = range(len(texts))
        if cached is not None:
            req.cached, req.results, req.remaining = cached, cached.results, len(cached.missing)
            if not cached.missing:  # every input answered: no tokenizer, queue or forward
                req.t_tokenized = req.t_done = time.perf_counter()
                req.future.set_result(req.results)
                return req
            index = cached.missing
            if cached.hits:
                texts = [texts[i] for i in index]
        n = len(texts)
        with self._cv:
            self._tokenizing += n

        def tokenized(encs, err):  # runs on a tokenizer thread
            req.t_tokenized = time.perf_counter()
            with self._cv:
                self._tokenizing -= n
            if err is not None:
                loop.call_soon_threadsafe(_fail, req, err)
                return
            if req.cancelled:
                return
            entries = []
            for i, (ids, tids) in zip(index, encs):
                entries.append(Entry(req, i, ids, tids, urgent))
                req.tokens += len(ids)
                self.stats.on_input_length(len(ids))
            if need_tokens and self.max_token_outputs and req.tokens > self.max_token_outputs:
                # refused before any forward: its answer (tokens x width floats, then JSON) would be what a small
                # request makes a replica hold
                width = getattr(self.backend, "hidden_size", None) or 0
                loop.call_soon_threadsafe(_fail, req, EngineError(VALIDATION, (
                    f"Input validation error: an answer of every token's state for {req.tokens} tokens "
                    f"({req.tokens * width * 4 >> 20} MiB of float32) is over the limit of "
                    f"{self.max_token_outputs} tokens (--max-embed-all-tokens); send fewer or shorter inputs")))
                return
            if alone and threading.get_ident() == loop_thread and self._run_inline(entries):
                return
            self.queue.put_many(entries, self._wake_needed)

        self.tokenizers.submit(EncodeJob(texts, truncate, direction, self.max_input_length, tokenized))
        return req

    def _run_inline(self, entries: list[Entry]) -> bool:
        """On the event loop, with `entries` just tokenized there: run their forward here and now if they are
        small and the engine is idle (True: answered, the futures are set). Otherwise the threads run them."""
        if not self.inline_tokens or self._inline_s >= INLINE_MAX_S:
            return False
        rows, cols = self.backend.bucket(len(entries), max(e.length for e in entries))
        if rows * cols > self.inline_tokens:
            return False
        with self._cv:
            if self._running or self._slot is not None or len(self.queue) or self._stop or self._beside():
                return False
            self._running += 1  # the inference threads leave the engine to us until _forward_done
            self._wide = self.wide_alone  # its session spins on every core
        prepared = self._prepare(entries, [])
        if prepared is None:  # its requests were failed (logged); the forward never ran
            self._forward_done()
            return True
        try:
            self._run_batch(*prepared, on_loop=True)
        except Exception as e:  # as on an inference thread: the requests get an answer, the loop goes on
            log.exception("inference failed")
            self._fail_entries(entries, EngineError(BACKEND, f"inference failed: {e}"))
        return True

    def _wake_needed(self) -> bool:
        """Caller holds cv, with inputs just queued: can a waiting thread act on them? An idle inference thread
        can (unless a wide forward holds every core); the batcher can while the look-ahead slot is empty. With
        every forward running and the slot full, the arrivals join that batch when it is picked up (top_up):
        waking the threads only to find that costs a thread switch per request."""
        return self._slot is None or (not self._wide and self._running < self.workers)

    # ---- batcher thread ----------------------------------------------------------------------
    def _batcher(self) -> None:
        lower_priority(self.nice)
        cv, q = self._cv, self.queue
        while True:
            with cv:
                while not self._stop and not (
                        (self._running >= self.workers or self._wide) and self._slot is None and len(q)):
                    cv.wait()
                if self._stop:
                    return
                entries, dropped = q.form()
            prepared = self._prepare(entries, dropped)
            if prepared is not None:
                with cv:
                    self._slot = prepared
                    cv.notify_all()

    def _prepare(self, entries: list[Entry], dropped: list[Entry]):
        if dropped:
            self.stats.on_dropped(len(dropped))
        if not entries:
            return None
        t = time.perf_counter()
        for e in entries:
            e.request.t_batched = t
        try:
            batch = self._build(entries)
        except Exception as e:  # never lose the entries silently
            log.exception("building a batch failed")
            self._fail_entries(entries, EngineError(BACKEND, f"batch assembly failed: {e}"))
            return None
        return entries, batch

    def _next(self):
        """The look-ahead batch (topped up with later arrivals) if one is ready, else form one here.
        Counts the forward as running; the caller runs it and calls _forward_done."""
        cv, q = self._cv, self.queue
        while True:
            with cv:
                while (self._wide or self._slot is None and not len(q)) and not self._stop:
                    cv.wait()
                if self._stop:
                    return None
                ready = None  # the look-ahead batch's padded arrays, when usable as they are
                if self._slot is not None:
                    self._linger()
                    if self._slot is None:  # another inference thread took it while we waited
                        continue
                    (entries, ready), self._slot = self._slot, None
                    extra, dropped = q.top_up(entries) if len(q) else ([], [])
                    if extra:
                        entries, ready = entries + extra, None
                else:
                    entries, dropped = q.form()
                self._running += 1
                parallel = self._parallel()
                self._wide = self.wide_alone and not parallel
                cv.notify_all()  # the batcher (or an idle inference thread) may start on the next batch now
            if ready is not None:
                if dropped:
                    self.stats.on_dropped(len(dropped))
                item = entries, ready
            else:
                item = self._prepare(entries, dropped)
            if item is not None:
                item[1].parallel = parallel
                return item
            self._forward_done()

    def _parallel(self) -> bool:
        """Caller holds cv and has counted its forward: will another forward run beside it?"""
        return self.workers > 1 and (self._running > 1 or len(self.queue) > 0 or self._beside())

    def _forward_done(self) -> None:
        with self._cv:
            self._running -= 1
            self._wide = False  # a wide forward never has another beside it: if one was running, this was it
            # Wake the waiting threads only when one of them can act: an inference thread on a queued input or
            # the look-ahead batch (the batcher waits for forwards to start, not end). After a lone query's
            # forward there is neither, and waking the batcher and the inference threads for nothing cost the
            # event loop ~0.1 ms a query (0.66 -> 0.57 ms round trip with the forward stubbed): each woken thread
            # takes a core and the GIL while the loop answers, and the latency session's threads still spin.
            if self._stop or self._slot is not None or len(self.queue):
                self._cv.notify_all()

    def _linger(self) -> None:
        """Caller holds cv and a look-ahead batch is in the slot: give inputs being tokenized a moment to join.
        (An idle inference thread does not wait like this while another forward runs: measured, c=16 266 ->
        244 texts/s with it; its bigger batches did not pay for the idle core.)"""
        entries, batch = self._slot
        wait = linger_s(self._forward_s, batch.input_ids.size, self.queue.forward_tokens, self._tokenizing)
        if not wait:
            return
        deadline = time.perf_counter() + wait
        while self._tokenizing > 0 and not self._stop:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cv.wait(left)

    def _build(self, entries: list[Entry]) -> Batch:
        shape = self.backend.bucket(len(entries), max(e.length for e in entries))
        batch = padded([e.ids for e in entries], [e.type_ids for e in entries], shape, self.backend.pad_id)
        batch.need_tokens = any(e.request.need_tokens for e in entries)
        batch.heads = frozenset(o for e in entries if e.request.outputs for o in e.request.outputs if o != "dense")
        return batch

    # ---- inference thread --------------------------------------------------------------------
    def _inference(self) -> None:
        lower_priority(self.nice)
        while True:
            item = self._next()
            if item is None:
                return
            entries, batch = item
            try:
                self._run_batch(entries, batch)
            except Exception as e:  # whatever fails, the thread survives and the requests get an answer
                log.exception("inference failed")
                self._fail_entries(entries, EngineError(BACKEND, f"inference failed: {e}"))

    def _run_batch(self, entries: list[Entry], batch: Batch, on_loop: bool = False) -> None:
        try:
            self.stats.on_batch(len(entries), int(batch.lengths[: len(entries)].sum()))
            t0 = time.perf_counter()
            out = self.backend.forward(batch)
            t1 = time.perf_counter()
        finally:
            self._forward_done()  # the look-ahead slot may be refilled while we post-process
        finished = []
        rows = len(entries)
        for r, e in enumerate(entries):
            req = e.request
            if not req.t_forward:
                req.t_forward = t0
            req.t_forwarded = t1
            if rows > req.batch_rows:
                req.batch_rows = rows
            req.beside = req.beside or batch.parallel
            if req.outputs:
                req.results[e.index] = multi_result(out, r, req.outputs)
            else:
                req.results[e.index] = out.tokens[r] if (req.need_tokens and out.tokens is not None) else out.pooled[r]
            req.t_queue += t0 - (req.t_tokenized or t0)
            req.t_infer += t1 - t0
            req.remaining -= 1
            if req.remaining == 0:
                finished.append(req)
        dt = t1 - t0
        if dt > 0:
            rate = len(entries) / dt * (self.workers if batch.parallel else 1)
            self._throughput = rate if not self._throughput else 0.8 * self._throughput + 0.2 * rate
            self._forward_s = dt if not self._forward_s else 0.8 * self._forward_s + 0.2 * dt
            if batch.input_ids.size <= self.inline_tokens and not batch.parallel:  # the inline forward's session
                self._inline_s = dt if not self._inline_s else 0.8 * self._inline_s + 0.2 * dt
        if finished:
            if on_loop:
                _finish_all(finished)
            else:
                finished[0].loop.call_soon_threadsafe(_finish_all, finished)

    def healthy(self) -> bool:
        """False if an engine thread died: /health then answers 503 so Kubernetes restarts the pod."""
        return all(t.is_alive() for t in self._threads) and self.tokenizers.alive()

    def _fail_entries(self, entries: list[Entry], err: EngineError) -> None:
        reqs = {id(e.request): e.request for e in entries}
        for req in reqs.values():
            req.loop.call_soon_threadsafe(_fail, req, err)

    def warmup(self, tokens: int) -> None:
        """Run one forward pass of `tokens` padded tokens (startup; surfaces OOM and compiles kernels)."""
        length = max(2, min(self.max_input_length, tokens))
        batch = _filler(max(1, tokens // length), length)
        self.backend.forward(batch)
        if self.workers > 1:  # the sessions used beside another forward too
            batch.parallel = True
            self.backend.forward(batch)
        if self.inline_tokens:  # the inline forward's size: its time decides whether the loop may run it
            small = _filler(1, max(2, self.inline_tokens))
            times = []
            for _ in range(3):  # the best of three: the first run of a new shape pays for its allocations
                t = time.perf_counter()
                self.backend.forward(small)
                times.append(time.perf_counter() - t)
            self._inline_s = min(times)
            log.info("a forward of %d tokens takes %.1f ms: lone queries run it on the event loop%s",
                     small.input_ids.size, self._inline_s * 1000,
                     "" if self._inline_s < INLINE_MAX_S else " (no: over the limit)")

    def close(self, tokenizers: bool = True) -> None:
        """Stop the threads; ``tokenizers``: the tokenizer pool too (False: another lane still uses it)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        # the other lane's test closes over both engines: dropped, so that a closed pair is freed at once (the
        # backend's sessions, memory-mapped model files included) rather than at the next garbage collection
        self._beside = _never
        if tokenizers:
            self.tokenizers.close()


def lower_priority(nice: int) -> None:
    """Run the calling thread at `nice` (Linux: a nice value is per thread). Raising it needs no privilege;
    lowering it again would (CAP_SYS_NICE), so a thread lowered here keeps that priority for life."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: the lane still orders work, unweighted
        log.warning("cannot lower the priority of thread %s: %s", threading.current_thread().name, exc)


def _never() -> bool:
    return False


def _filler(rows: int, length: int) -> Batch:
    """A batch of `rows` x `length` real tokens (warm-up and its timings)."""
    ids = np.full((rows, length), 101, dtype=np.int64)
    return Batch(ids, np.ones_like(ids), np.zeros_like(ids), np.full(rows, length, dtype=np.int64))


def _finish_all(reqs: list[Request]) -> None:
    """On the event loop: answer the requests whose last input was computed; their computed answers join the
    answer cache (the loop is the only thread that touches it)."""
    t = time.perf_counter()
    for req in reqs:
        req.t_done = t
        if req.cached is not None:
            req.cached.keep()
        if not req.future.done():
            req.future.set_result(req.results)


def _fail(req: Request, err: EngineError) -> None:
    req.cancelled = True  # its other inputs still queued are dropped, not computed
    if not req.future.done():
        req.future.set_exception(err)
        req.future.exception()  # mark retrieved: a cancelled waiter must not log "never retrieved"
