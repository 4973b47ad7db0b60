"""Inputs that arrive while every inference thread runs a forward and the look-ahead batch is formed wake no
thread (each wake-up is a thread switch and a turn of the GIL for nothing: nobody can act on them); they join
the look-ahead batch when an inference thread picks it up. Checked on the real engine and tokenizer with a
backend whose forwards take long enough to arrive during them."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from embedops_server.core.batch import BatchOutput
from embedops_server.core.engine import Engine

FORWARD_S = 0.25


class SlowBackend:
    """Each row's answer is the sum of its token ids; every forward takes FORWARD_S and records its rows."""
    device = "cpu"
    pad_id = 0
    parallel_forwards = 2
    inline_tokens = 0
    wide_alone = False

    def __init__(self):
        self.rows: list[int] = []
        self._lock = threading.Lock()

    def bucket(self, rows, cols):
        return rows, cols

    def forward(self, batch):
        time.sleep(FORWARD_S)
        with self._lock:
            self.rows.append(int((batch.lengths > 0).sum()))
        return BatchOutput((batch.input_ids * batch.attention_mask).sum(1, keepdims=True).astype(np.float32))


def test_arrivals_during_busy_forwards_with_the_slot_full_wake_nobody_and_join_the_next_batch(
        minilm_tokenizer_pool):
    backend = SlowBackend()
    engine = Engine(backend, minilm_tokenizer_pool, 128, 16384, None, 1024, workers=2)
    notifies = []
    cv_notify_all = engine.queue.cv.notify_all

    def counting_notify_all():
        notifies.append(time.perf_counter())
        cv_notify_all()

    engine.queue.cv.notify_all = counting_notify_all
    texts = [f"question {i} about dynamic batching" for i in range(9)]

    async def go():
        async def send(t):
            engine.hold(1)
            return engine.submit([t], True, "right")

        reqs = []
        for t in texts[:2]:  # one forward on each inference thread
            reqs.append(await send(t))
            await asyncio.sleep(0.03)
        reqs.append(await send(texts[2]))  # the batcher forms it into the look-ahead slot
        await asyncio.sleep(0.03)
        with engine.queue.cv:
            busy = engine._running == 2 and engine._slot is not None
        before = len(notifies)
        late = [await send(t) for t in texts[3:]]  # both forwards still run: nobody can act on these
        woken = len(notifies) - before
        reqs += late
        answers = [(await asyncio.wait_for(r.future, 30))[0][0] for r in reqs]
        return busy, woken, answers

    try:
        busy, woken, answers = asyncio.run(go())
    finally:
        engine.close()
    assert busy, "the setup did not reach two running forwards and a full look-ahead slot"
    assert woken == 0
    assert answers == [float(sum(minilm_tokenizer_pool.tokenizer.encode(t).ids)) for t in texts]
    # the slot's input and the six late ones in one forward (top-up), not one forward each
    assert sorted(backend.rows) == [1, 1, 7]
