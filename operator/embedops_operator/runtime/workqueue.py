"""A work queue of keys (the controller's: namespace and name): each key waits at most once, and is never worked on
by two threads.

An event for a key that is already waiting merges into it (a full reconcile wins over a status-only one);
an event for a key being worked on marks it to run again after. Failed keys come back after a backoff
(0.5 s doubling to `max_backoff`), or at once with `retry_failed_now()` (the API server is back).
With `coalesce` > 0 that run again waits `coalesce` seconds, merging every event meanwhile, and so does a full
reconcile asked for within `coalesce` seconds after the end of one (a change that arrives between two runs, not
during one: with runs quicker than the changes, most did): a service whose spec changes many times a second is
reconciled (its Deployment written) about once per window, not once per change, and the last change wins (fault
test: 100 spec changes in 10 s). A status-only run is never held back that way. Both waits are entries of one
heap served by one thread (delayed.py), however many keys wait.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from .delayed import DelayedCalls

Key = tuple[str, str]


class WorkQueue:
    def __init__(self, max_backoff: float = 60.0, coalesce: float = 0.0):
        self._cond = threading.Condition()
        self._order: deque[Key] = deque()
        self._waiting: dict[Key, bool] = {}  # key -> full reconcile (apply children) wanted
        self._active: set[Key] = set()
        self._again: dict[Key, bool] = {}  # keys whose events came while they were worked on
        self._failures: dict[Key, int] = {}
        # ("retry", key): a failed key's back-off; ("release", key): the end of a key's coalescing window
        self._delays = DelayedCalls("workqueue-delays")
        self._closed = False
        self.max_backoff = max_backoff
        self.coalesce = coalesce
        self._held: dict[Key, bool] = {}  # keys in their coalescing window
        self._running_full: dict[Key, bool] = {}  # what each active key's run is
        self._cool_until: dict[Key, float] = {}  # keys whose last full run ended less than `coalesce` ago
        self._since: dict[Key, float] = {}  # when each waiting key entered the queue
        self.observe_wait: Callable[[float], None] | None = None  # seconds a key waited, when a worker takes it

    def add(self, key: Key, full: bool = True) -> None:
        with self._cond:
            if self._closed:
                return
            if key in self._active:
                self._again[key] = self._again.get(key, False) or full
            elif key in self._held:
                self._held[key] = self._held[key] or full
            elif key in self._waiting:
                self._waiting[key] = self._waiting[key] or full
            elif full and self._cooling(key):
                self._held[key] = True
                self._delays.call_later(("release", key), self._cool_until[key] - time.monotonic(),
                                        lambda: self._release(key))
            else:
                self._waiting[key] = full
                self._since[key] = time.monotonic()
                self._order.append(key)
                self._cond.notify()

    def _cooling(self, key: Key) -> bool:
        """Whether `key`'s last full run ended less than `coalesce` ago (callers hold the lock)."""
        until = self._cool_until.get(key)
        if until is not None and until <= time.monotonic():
            del self._cool_until[key]
            until = None
        return until is not None

    def get(self, timeout: float | None = None) -> tuple[Key, bool] | None:
        """The next key and whether to apply children; None when closed (or after `timeout`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._order:
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            key = self._order.popleft()
            full = self._waiting.pop(key)
            waited = time.monotonic() - self._since.pop(key, time.monotonic())
            self._active.add(key)
            self._running_full[key] = full
        if self.observe_wait is not None:
            self.observe_wait(waited)
        return key, full

    def done(self, key: Key, ok: bool = True) -> None:
        with self._cond:
            self._active.discard(key)
            if self._running_full.pop(key, False) and ok and self.coalesce > 0:
                self._cool_until[key] = time.monotonic() + self.coalesce
            if ok:
                self._failures.pop(key, None)
            again = self._again.pop(key, None)
            hold = again is not None and self.coalesce > 0 and not self._closed
            if hold:
                self._held[key] = again
        if hold:
            self._delays.call_later(("release", key), self.coalesce, lambda: self._release(key))
        elif again is not None:
            self.add(key, again)
        elif not ok:
            self._retry_later(key)

    def _release(self, key: Key) -> None:
        with self._cond:
            full = self._held.pop(key, None)
        if full is not None:
            self.add(key, full)

    def _retry_later(self, key: Key) -> None:
        with self._cond:
            n = self._failures[key] = self._failures.get(key, 0) + 1
            delay = min(0.5 * 2 ** (n - 1), self.max_backoff)
        self._delays.call_later(("retry", key), delay, lambda: self.add(key, True))

    def backoff(self, key: Key) -> float | None:
        """Seconds until a failed key is tried again, or None when it is not waiting out a back-off."""
        return self._delays.due_in(("retry", key))

    def retry_failed_now(self) -> int:
        """Every key waiting out a failure back-off is queued now and its back-off reset (the API server is
        reachable again: what failed during the outage need not wait up to `max_backoff`). Returns how many."""
        with self._cond:
            if self._closed:
                return 0
            self._failures.clear()
        keys = [k for kind, k in self._delays.keys() if kind == "retry" and self._delays.cancel((kind, k))]
        for key in keys:
            self.add(key, True)
        return len(keys)

    def failing(self) -> int:
        """Keys waiting out a failure back-off."""
        return sum(1 for kind, _ in self._delays.keys() if kind == "retry")

    def forget(self, key: Key) -> None:
        with self._cond:
            self._failures.pop(key, None)
        self._delays.cancel(("retry", key))

    def __len__(self) -> int:
        with self._cond:
            return len(self._order)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._delays.close()
