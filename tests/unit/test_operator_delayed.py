"""delayed.DelayedCalls: calls due later from one thread (the work queue's back-offs and coalescing windows, the
reconciler's status rechecks), and what it replaced: a thread per waiting key."""
from __future__ import annotations

import threading
import time

from embedops_operator.runtime.delayed import DelayedCalls
from embedops_operator.runtime.workqueue import WorkQueue


def wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_calls_run_in_due_order_and_a_key_has_one_pending_call():
    d = DelayedCalls()
    seen: list[str] = []
    d.call_later("b", 0.2, lambda: seen.append("b"))
    d.call_later("a", 0.1, lambda: seen.append("a"))
    d.call_later("c", 0.05, lambda: seen.append("c-old"))
    d.call_later("c", 0.3, lambda: seen.append("c"))  # replaces c's pending call
    assert len(d) == 3 and 0.2 < d.due_in("c") <= 0.3
    wait(lambda: len(seen) == 3)
    assert seen == ["a", "b", "c"] and len(d) == 0 and d.due_in("c") is None
    d.close()


def test_keep_earlier_keeps_the_sooner_call_and_cancel_drops_one():
    d = DelayedCalls()
    seen: list[str] = []
    assert d.call_later("k", 0.1, lambda: seen.append("soon"), keep_earlier=True)
    assert not d.call_later("k", 5, lambda: seen.append("late"), keep_earlier=True)
    assert d.call_later("x", 0.05, lambda: seen.append("x"))
    assert d.cancel("x") and not d.cancel("x")
    wait(lambda: seen == ["soon"])
    time.sleep(0.1)
    assert seen == ["soon"]
    d.close()
    assert not d.call_later("k", 0, lambda: seen.append("after close"))


def test_a_failing_call_does_not_stop_the_others(caplog):
    d = DelayedCalls("t")
    seen: list[int] = []
    d.call_later(1, 0.01, lambda: 1 / 0)
    d.call_later(2, 0.02, lambda: seen.append(2))
    wait(lambda: seen == [2])
    assert any("delayed call for 1 failed" in r.getMessage() for r in caplog.records)
    d.close()


def test_a_thousand_failing_keys_wait_out_their_backoff_on_one_thread():
    """An API-server outage with 1,000 services: each failed key waits out its back-off, all on one thread (the
    Timer per key it replaced made 1,000), and every one comes back."""
    before = threading.active_count()
    q = WorkQueue(max_backoff=60)
    keys = [("ml", f"s{i}") for i in range(1000)]
    for k in keys:
        q.add(k)
    for _ in keys:
        key, _full = q.get(0)
        q.done(key, ok=False)
    assert q.failing() == 1000
    assert threading.active_count() - before <= 1
    back = set()
    deadline = time.monotonic() + 5
    while len(back) < len(keys) and time.monotonic() < deadline:
        item = q.get(0.5)
        if item:
            back.add(item[0])
            q.done(item[0])
    assert back == set(keys) and q.failing() == 0
    q.close()
