"""Calls due later, from one thread: a heap of due times, at most one pending call per key.

The work queue's failure back-offs and coalescing windows and the reconciler's status rechecks used one
``threading.Timer`` (one thread) each: an API-server outage with 1,000 failing services was 1,000 sleeping threads.
Here they are entries of one heap, served by one daemon thread started on first use. A call runs on that thread,
so it must be short (queueing a key is; a reconcile is not, and goes through the work queue instead).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger("embedops.delayed")


class DelayedCalls:
    def __init__(self, name: str = "delayed-calls"):
        self.name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._pending: dict[Hashable, tuple[float, int, Callable[[], None]]] = {}  # key -> (due, seq, call)
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def call_later(self, key: Hashable, delay: float, call: Callable[[], None], keep_earlier: bool = False) -> bool:
        """Run ``call`` in ``delay`` seconds instead of ``key``'s pending call, if any; with ``keep_earlier`` a
        pending call due no later stays and this one is dropped. Returns whether this call was scheduled."""
        due = time.monotonic() + max(0.0, delay)
        with self._cond:
            if self._closed:
                return False
            pending = self._pending.get(key)
            if keep_earlier and pending is not None and pending[0] <= due:
                return False
            seq = next(self._seq)
            self._pending[key] = (due, seq, call)
            heapq.heappush(self._heap, (due, seq, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return True

    def cancel(self, key: Hashable) -> bool:
        """Drop ``key``'s pending call (its heap entry is skipped when it comes up). Whether there was one."""
        with self._cond:
            return self._pending.pop(key, None) is not None

    def due_in(self, key: Hashable) -> float | None:
        """Seconds until ``key``'s pending call, or None."""
        with self._cond:
            pending = self._pending.get(key)
        return None if pending is None else max(0.0, pending[0] - time.monotonic())

    def keys(self) -> list[Hashable]:
        with self._cond:
            return list(self._pending)

    def __len__(self) -> int:
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Drop every pending call and stop the thread."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._heap.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due, seq, key = self._heap[0]
                    pending = self._pending.get(key)
                    if pending is None or pending[1] != seq:  # cancelled or replaced
                        heapq.heappop(self._heap)
                        continue
                    left = due - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                        continue
                    heapq.heappop(self._heap)
                    del self._pending[key]
                    call = pending[2]
                    break
            try:
                call()
            except Exception:  # noqa: BLE001 - one failing call must not stop the others
                log.exception("%s: delayed call for %r failed", self.name, key)
