"""Interactive and batch lanes: a query's input never waits behind an ingestion job's.

One server takes both kinds of client: ingestion sends large lots with no latency target, the query path one
short text per question with a latency budget. In one FIFO queue a query waits for every ingestion input queued
before it (2-3 s beside four ingestion clients on 2 cores, for a 6 ms query: docs/bench.md). So a request is
sorted into a lane (`choose_lane`): explicitly by its client, else by the service's default.

How the lanes share the model depends on whether the backend can run two forwards at once:

- ``separate`` (ONNX Runtime on CPU): an engine per lane over the one backend and tokenizer pool. The batch
  lane's threads run at a lower priority (``batch_nice``): a query's forward starts as soon as it is formed,
  beside the batch forwards running, and the kernel gives its threads the cores first. A forward cannot be
  paused, and on 2 cores one batch forward lasts 50-500 ms; waiting for the next one would be the FIFO wait
  again. The batch lane is not starved: a nice value weighs threads, it does not stop them (nice 10 against 0
  is about 1 to 10 of a contended core), and it has every core while no query runs.
- ``shared`` (torch, GPU): one engine; the interactive lane's inputs head the next forward (core/queue.py), the
  batch lane heading at least one forward in URGENT_RUN + 1 while both wait. A GPU forward is short: the wait
  is at most the forward that runs.

Admission is per lane over one limit of inputs in flight: the batch lane is refused (429) once the inputs in
flight reach ``batch_limit``, the interactive lane only at ``max_concurrent`` (the whole limit).
"""
from __future__ import annotations

from typing import Callable

from .. import sizing
from .engine import Engine
from .errors import OVERLOADED, VALIDATION, EngineError
from .queue import URGENT_RUN

INTERACTIVE, BATCH = "interactive", "batch"
LANES = (INTERACTIVE, BATCH)
AUTO = "auto"
DEFAULTS = (AUTO, INTERACTIVE, BATCH)

__all__ = ["INTERACTIVE", "BATCH", "LANES", "AUTO", "DEFAULTS", "URGENT_RUN", "Lanes", "choose_lane"]


def choose_lane(explicit: str | None, inputs: int, default: str, auto_max_inputs: int, query: bool = False) -> str:
    """The lane of a request: `explicit` (the client's word: "interactive" or "batch") when given, else the
    service's `default`; "auto" makes a request of at most `auto_max_inputs` inputs interactive, and a `query`
    one (a rerank: one question's candidates) interactive whatever its size. Raises EngineError(VALIDATION)
    for an unknown word."""
    if explicit:
        lane = explicit.strip().lower()
        if lane not in LANES:
            raise EngineError(VALIDATION, f"Input validation error: lane must be one of {', '.join(LANES)} "
                                          f"(got {explicit[:40]!r})")
        return lane
    if default != AUTO:
        return default
    return INTERACTIVE if query or inputs <= auto_max_inputs else BATCH


class Lanes:
    """The engines of the lanes and their admission. ``engines`` maps each lane to its engine: two engines
    (separate), or the same one twice (shared, or lanes off: ``enabled`` False, every request in one FIFO)."""

    def __init__(self, engines: dict[str, Engine], max_concurrent: int, batch_limit: int | None = None,
                 enabled: bool = True):
        self.engines = engines
        self.max_concurrent = max_concurrent
        self.batch_limit = max_concurrent if batch_limit is None else min(batch_limit, max_concurrent)
        self.enabled = enabled
        self.separate = engines[INTERACTIVE] is not engines[BATCH]
        self._in_flight = {lane: 0 for lane in LANES}
        # answers of every token's state (/embed_all, ColBERT: tokens x width floats, then their JSON) held at
        # once, from admission until sent: the memory estimate counts this many (sizing.RESPONSES_IN_FLIGHT)
        self.max_token_answers = sizing.RESPONSES_IN_FLIGHT  # --max-token-answers (service.make_lanes)
        self.token_answers = 0

    @classmethod
    def one(cls, engine: Engine, enabled: bool = False, batch_limit: int | None = None) -> "Lanes":
        """Both lanes on one engine: lanes off (`enabled` False, FIFO), or shared (interactive inputs first)."""
        if enabled:
            engine.urgent_lane = INTERACTIVE
        return cls({INTERACTIVE: engine, BATCH: engine}, engine.max_concurrent, batch_limit, enabled)

    @classmethod
    def separate_engines(cls, make: Callable[..., Engine], max_concurrent: int, batch_limit: int,
                         batch_nice: int) -> "Lanes":
        """An engine per lane from `make(**lane options)`; each runs its forwards narrow while the other lane is
        busy (the batch lane: holds admitted work; the interactive lane: runs a forward)."""
        engines: dict[str, Engine] = {}
        # A query runs narrow while the batch lane holds any work, not only while one of its forwards runs: between
        # two batch forwards a wide query would take the latency session, whose threads spin after it at normal
        # priority on the cores the batch lane is about to use.
        engines[INTERACTIVE] = make(lane=INTERACTIVE, beside=lambda: engines[BATCH].in_flight > 0)
        engines[BATCH] = make(lane=BATCH, nice=batch_nice, inline=False,
                              beside=lambda: engines[INTERACTIVE].running())
        return cls(engines, max_concurrent, batch_limit)

    @property
    def primary(self) -> Engine:
        """The engine a lane-free caller uses (warm-up, settings): the interactive lane's."""
        return self.engines[INTERACTIVE]

    def distinct(self) -> list[Engine]:
        return [self.engines[INTERACTIVE]] + ([self.engines[BATCH]] if self.separate else [])

    def engine(self, lane: str) -> Engine:
        return self.engines[lane]

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    def in_flight_of(self, lane: str) -> int:
        """Admitted inputs of one lane not yet answered."""
        return self._in_flight[lane]

    def queued(self, lane: str | None = None) -> int:
        """Inputs waiting in a lane's queue (None: all of them). With lanes off every input counts as batch."""
        if lane is None:
            return sum(len(e.queue) for e in self.distinct())
        queue = self.engines[lane].queue
        if self.separate:
            return len(queue)
        if not self.enabled:
            return len(queue) if lane == BATCH else 0
        return queue.urgent_waiting if lane == INTERACTIVE else len(queue) - queue.urgent_waiting

    def admit(self, lane: str, n: int) -> None:
        """Count `n` inputs in, or raise EngineError(OVERLOADED) (429, Retry-After) if the lane's limit is full.
        Event loop only."""
        limit = self.max_concurrent if lane == INTERACTIVE or not self.enabled else self.batch_limit
        engine = self.engines[lane]
        if n > limit:  # never admissible, however idle the server: a 429 would be retried forever (the settings
            # refuse such a --max-client-batch-size at start; this holds for any caller)
            raise EngineError(VALIDATION, f"batch size {n} > the {lane} lane's limit of inputs in flight {limit}")
        if self.in_flight + n > limit:
            # TEI's message when the whole budget is full; the batch lane's own limit says so
            which = " (batch lane)" if limit < self.max_concurrent else ""
            raise EngineError(OVERLOADED, f"Model is overloaded{which}", retry_after=engine.retry_after())
        engine.hold(n)  # (Retry-After reads the engine's own count against its throughput)
        self._in_flight[lane] += n

    def release(self, lane: str, n: int) -> None:
        self.engines[lane].release(n)
        self._in_flight[lane] -= n

    def admit_token_answer(self) -> None:
        """Count in an answer of every token's state, or raise EngineError(OVERLOADED) (429, Retry-After) while
        `max_token_answers` are in progress: each holds up to --max-embed-all-tokens x width floats (a ColBERT
        request, its inputs' tokens), and what a replica holds must not grow with the number of such clients.
        Never a request that cannot pass: one is always admitted on its own. Event loop only."""
        if self.token_answers >= self.max_token_answers:
            raise EngineError(OVERLOADED, f"Model is overloaded ({self.token_answers} answers of every token's "
                                          "state in progress)", retry_after=1)
        self.token_answers += 1

    def release_token_answer(self) -> None:
        self.token_answers -= 1

    def healthy(self) -> bool:
        return all(e.healthy() for e in self.distinct())

    def close(self) -> None:
        for i, e in enumerate(self.distinct()):
            e.close(tokenizers=i == 0)  # one pool under both engines: closed once
