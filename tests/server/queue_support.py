"""Queue entries and draining shared by the batch-formation tests."""
from __future__ import annotations

from embedops_server.core.queue import Entry


class Req:
    cancelled = False


def entries(lengths):
    r = Req()
    return [Entry(r, i, [1] * n, [0] * n) for i, n in enumerate(lengths)]


def drain(q):
    out = []
    while len(q):
        b, _ = q.next_batch(timeout=0)
        out.append(b)
    return out
