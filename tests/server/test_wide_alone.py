"""With two inference threads, a forward that started alone runs on every core and no second forward starts
beside it (more compute threads than cores); two narrow forwards still run side by side when the queue holds
more than one batch. Checked on the real engine with a backend that records when each forward ran."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from embedops_server.core import engine as engine_mod
from embedops_server.core.batch import BatchOutput


class RecordingBackend:
    """Answers each row with the sum of its token ids (so a mixed-up answer shows); every forward takes
    FORWARD_S and is recorded as (start, end, parallel, rows)."""
    FORWARD_S = 0.03
    device = "cpu"
    pad_id = 0
    parallel_forwards = 2
    inline_tokens = 0

    def __init__(self, wide_alone: bool):
        self.wide_alone = wide_alone
        self.forwards: list[tuple[float, float, bool, int]] = []
        self._lock = threading.Lock()

    def bucket(self, rows, cols):
        return rows, cols

    def forward(self, batch):
        t0 = time.perf_counter()
        time.sleep(self.FORWARD_S)
        with self._lock:
            self.forwards.append((t0, time.perf_counter(), batch.parallel, int((batch.lengths > 0).sum())))
        return BatchOutput((batch.input_ids * batch.attention_mask).sum(1, keepdims=True).astype(np.float32))


def run_load(pool, wide_alone: bool, texts: list[str], spacing_s: float):
    """One text per request, submitted `spacing_s` apart on one event loop; returns (answers, forwards)."""
    backend = RecordingBackend(wide_alone)
    engine = engine_mod.Engine(backend, pool, 128, 16384, 4, 1024, workers=2)

    async def go():
        reqs = []
        for t in texts:
            engine.hold(1)
            reqs.append(engine.submit([t], True, "right"))
            await asyncio.sleep(spacing_s)
        return [(await asyncio.wait_for(r.future, 30))[0][0] for r in reqs]

    try:
        answers = asyncio.run(go())
    finally:
        engine._stop = True
        with engine.queue.cv:
            engine.queue.cv.notify_all()
    expected = [float(sum(pool.tokenizer.encode(t).ids)) for t in texts]
    assert answers == expected  # every request got its own row's answer
    return backend.forwards


def overlaps_of_wide(forwards) -> int:
    """Forwards that ran (partly) while a wide (not parallel) forward ran."""
    n = 0
    for s, e, parallel, _ in forwards:
        if parallel:
            continue
        n += sum(1 for s2, e2, _, _ in forwards if (s2, e2) != (s, e) and s2 < e and e2 > s)
    return n


def test_no_forward_starts_beside_a_wide_one_and_two_narrow_ones_still_pair(minilm_tokenizer_pool):
    # a trickle (arrivals while a lone forward runs) and then a burst (a queue deeper than one batch)
    trickle = [f"query number {i} about vector search" for i in range(12)]
    burst = [f"passage {i} on batching and backpressure" for i in range(16)]
    forwards = run_load(minilm_tokenizer_pool, True, trickle, RecordingBackend.FORWARD_S / 3)
    forwards += run_load(minilm_tokenizer_pool, True, burst, 0)
    assert overlaps_of_wide(forwards) == 0
    assert any(not p for _, _, p, _ in forwards)  # some forwards ran alone, on every core
    narrow = sorted((s, e) for s, e, p, _ in forwards if p)
    assert any(s2 < e for (s, e), (s2, _) in zip(narrow, narrow[1:]))  # and narrow ones side by side
    assert sum(rows for *_, rows in forwards) == len(trickle) + len(burst)


def test_the_switch_lets_a_forward_join_a_wide_one(minilm_tokenizer_pool):
    """EMBEDOPS_ORT_WIDE_ALONE=0's engine side: arrivals while a lone forward runs start beside it at once
    (what the test above would catch)."""
    trickle = [f"query number {i} about vector search" for i in range(12)]
    forwards = run_load(minilm_tokenizer_pool, False, trickle, RecordingBackend.FORWARD_S / 3)
    assert overlaps_of_wide(forwards) > 0


def test_ort_backend_sets_it_for_float32_with_its_parallel_forwards(monkeypatch, tmp_path):
    """On for a float32 graph with two forwards, off for int8 (measured: its c=16 lost 3-7% of throughput with
    it) and with one forward at a time; the variable forces it either way."""
    import tokenizers

    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_onnx_dir

    monkeypatch.setenv("EMBEDOPS_ORT_SMALL_TOKENS", "0")  # no latency session: not what this checks
    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    tok = tokenizers.Tokenizer.from_file(str(info.path / "tokenizer.json"))
    tok.no_padding()
    assert OrtBackend(info, threads=2).wide_alone
    assert not OrtBackend(info, threads=1).wide_alone  # one forward at a time: nothing to keep apart
    int8 = OrtBackend(info, threads=2, quantize="int8", cache=str(tmp_path), tokenizer=tok)
    assert int8.dtype == "int8" and int8.parallel_forwards == 2 and not int8.wide_alone
    monkeypatch.setenv("EMBEDOPS_ORT_WIDE_ALONE", "1")
    assert OrtBackend(info, threads=2, quantize="int8", cache=str(tmp_path), tokenizer=tok).wide_alone
    monkeypatch.setenv("EMBEDOPS_ORT_WIDE_ALONE", "0")
    assert not OrtBackend(info, threads=2).wide_alone
