"""Batch formation: token budget, request cap, length-aware grouping, no starvation, cancelled entries."""
from __future__ import annotations

import random

from embedops_server.core.queue import BatchQueue

from tests.server.queue_support import drain, entries, next_batch


def test_budget_and_cap_respected():
    random.seed(0)
    q = BatchQueue(max_batch_tokens=1024, max_batch_requests=16)
    es = entries([random.randint(1, 256) for _ in range(300)])
    q.put_many(es)
    batches = drain(q)
    assert sorted(e.seq for b in batches for e in b) == sorted(e.seq for e in es)  # nothing lost or duplicated
    for b in batches:
        assert max(e.length for e in b) * len(b) <= 1024 and len(b) <= 16


def test_length_grouping_cuts_padding():
    # the case: 32 texts of 16-256 tokens; FIFO padding to the longest wastes ~40%
    random.seed(1)
    lengths = [random.randint(16, 256) for _ in range(32)]
    q = BatchQueue(max_batch_tokens=16384, max_batch_requests=None)
    q.put_many(entries(lengths))
    batches = drain(q)
    real = sum(lengths)
    padded = sum(max(e.length for e in b) * len(b) for b in batches)
    fifo_padded = max(lengths) * len(lengths)
    assert padded < 0.8 * fifo_padded
    assert real / padded >= 0.75, (real, padded, len(batches))
    assert len(batches) <= 8


def test_oldest_entry_is_never_starved():
    q = BatchQueue(max_batch_tokens=512, max_batch_requests=None)
    old = entries([250])[0]
    q.put_many([old])
    for _ in range(20):  # a stream of short entries keeps arriving
        q.put_many(entries([8] * 40))
        b, _ = next_batch(q)
        if old in b:
            break
    else:
        raise AssertionError("long entry starved")
    assert b[0] is old or old in b


def test_cancelled_entries_are_dropped():
    q = BatchQueue(max_batch_tokens=1024, max_batch_requests=None)
    keep, gone = entries([10, 10]), entries([10, 10, 10])
    gone[0].request.cancelled = True
    q.put_many(keep + gone)
    b, dropped = next_batch(q)
    assert set(b) == set(keep) and set(dropped) == set(gone)
    assert len(q) == 0


def test_top_up_adds_later_arrivals_that_fit():
    q = BatchQueue(max_batch_tokens=1024, max_batch_requests=8)
    q.put_many(entries([20, 22]))
    batch, _ = next_batch(q)
    assert len(batch) == 2
    later = entries([21, 500, 19, 23, 18, 20, 22, 24, 25])  # 500 would blow the padding: left for later
    q.put_many(later)
    with q.cv:
        extra, dropped = q.top_up(batch)
    assert dropped == []
    assert later[1] not in extra and len(batch) + len(extra) == 8  # request cap
    assert [e.seq for e in extra] == sorted(e.seq for e in extra)  # oldest first
    rest = drain(q)
    assert sorted(e.seq for b in rest for e in b) == sorted(e.seq for e in later if e not in extra)
