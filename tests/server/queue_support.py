"""Queue entries and draining shared by the batch-formation tests."""
from __future__ import annotations

from embedops_server.core.queue import Entry


class Req:
    cancelled = False


def entries(lengths):
    r = Req()
    return [Entry(r, i, [1] * n, [0] * n) for i, n in enumerate(lengths)]


def next_batch(q):
    """The batch the engine's loop would form now: (batch, cancelled entries skipped)."""
    with q.cv:
        return q.form()


def drain(q):
    out = []
    while len(q):
        b, _ = next_batch(q)
        out.append(b)
    return out
