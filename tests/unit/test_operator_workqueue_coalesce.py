"""The work queue's coalescing window (fault test: 100 spec changes in 10 s write the Deployment a few times)."""
from __future__ import annotations

import time

from embedops_operator.runtime.workqueue import WorkQueue


def test_events_during_a_reconcile_wait_one_window_and_merge():
    q = WorkQueue(coalesce=0.3)
    key = ("ml", "a")
    q.add(key, full=False)
    assert q.get(0) == (key, False)          # the first event runs at once
    for _ in range(5):
        q.add(key, full=False)               # a burst while it is worked on
    q.done(key)
    t0 = time.monotonic()
    for _ in range(5):
        q.add(key, full=True)                # ... and during the window: merged, not queued
        assert q.get(0) is None
    assert q.get(2) == (key, True)           # one run for all eleven events, a full one
    assert 0.25 < time.monotonic() - t0 < 1.5
    q.done(key)
    q.add(key, full=False)                   # quiet again: no window
    assert q.get(0) == (key, False)
    q.close()


def test_without_coalescing_the_run_again_is_immediate():
    q = WorkQueue()
    key = ("ml", "a")
    q.add(key)
    assert q.get(0) == (key, True)
    q.add(key, full=False)
    q.done(key)
    assert q.get(0) == (key, False)
    q.close()


def test_a_change_between_two_runs_waits_out_the_window_of_the_last_full_one():
    """Changes every 100 ms, each run quicker than that: before, every change that came between two runs (most)
    ran at once, so 100 spec changes in 10 s wrote the Deployment 16 times on a fast machine (bound: 15)."""
    q = WorkQueue(coalesce=0.3)
    key = ("ml", "a")
    q.add(key)
    assert q.get(0) == (key, True)
    q.done(key)                              # a full run ended: its window starts
    t0 = time.monotonic()
    q.add(key, full=False)                   # a status-only run is never held back
    assert q.get(0) == (key, False)
    q.done(key)
    for _ in range(3):
        q.add(key, full=True)                # spec changes between runs: held, merged
        assert q.get(0) is None
    assert q.get(2) == (key, True)
    assert 0.25 < time.monotonic() - t0 < 1.5
    q.done(key, ok=False)                    # a failed run starts no window: its back-off applies
    q.close()
