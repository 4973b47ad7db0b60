"""A lone small request runs its forward on the event loop's thread (no hop to an inference thread and back);
anything else, or anything while the engine is busy, goes through the threads as before."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from embedops_server.core import engine as engine_mod
from embedops_server.core.errors import BACKEND, EngineError


@pytest.fixture(scope="module")
def engine():
    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.model_info import load_model_info
    from embedops_server.core.tokenization import TokenizerPool
    from localcluster.models import minilm_onnx_dir

    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    backend = OrtBackend(info, threads=2)
    tokenizers = TokenizerPool(str(info.path / "tokenizer.json"), 1)
    eng = engine_mod.Engine(backend, tokenizers, 128, 16384, None, 64, workers=backend.parallel_forwards)
    eng.warmup(128)
    assert eng._inline_s > 0  # warmup timed a forward of the inline size
    # the gate, not this machine's speed (a busy test machine can take far longer than INLINE_MAX_S)
    eng._inline_s = engine_mod.INLINE_MAX_S / 10
    yield eng
    eng.close()


class Threads:
    """Wraps backend.forward: which thread ran each forward, and how many rows."""

    def __init__(self, backend, fail: bool = False):
        self.backend, self.real, self.fail, self.seen = backend, backend.forward, fail, []

    def __enter__(self):
        def forward(batch):
            self.seen.append((threading.current_thread().name, len(batch.lengths)))
            if self.fail:
                raise RuntimeError("boom")
            return self.real(batch)

        self.backend.forward = forward
        return self

    def __exit__(self, *exc):
        self.backend.forward = self.real


def submit(engine, texts, fast: bool = True):
    """Submit on a fresh event loop; ``fast``: as if forwards this small took a tenth of the limit (the gate
    under test, not this machine's speed: the forwards on the threads move the average too)."""
    if fast:
        engine._inline_s = engine_mod.INLINE_MAX_S / 10

    async def go():
        req = engine.submit(texts, True, "right")
        answered_at_once = req.future.done()
        return answered_at_once, await asyncio.wait_for(req.future, 30)
    return asyncio.run(go())


def test_a_lone_query_is_answered_on_the_loop_with_the_threads_result(engine):
    assert engine.inline_tokens == engine.backend.small_tokens > 0
    with Threads(engine.backend) as seen:
        at_once, inline = submit(engine, ["what is an embedding?"])
    assert at_once and seen.seen == [("MainThread", 1)]
    engine.inline_tokens, saved = 0, engine.inline_tokens
    try:
        with Threads(engine.backend) as seen:
            at_once, threaded = submit(engine, ["what is an embedding?"])
    finally:
        engine.inline_tokens = saved
    assert not at_once and seen.seen[0][0].startswith("inference")
    assert np.allclose(inline[0], threaded[0], atol=1e-6)


def test_a_lone_query_wakes_no_engine_thread(engine, monkeypatch):
    """After an inline forward nothing is queued: waking the batcher and the inference threads would only make
    them take a core and the GIL from the event loop while it answers (~0.1 ms a query, measured)."""
    cv = engine.queue.cv
    woken = []
    real = cv.notify_all
    monkeypatch.setattr(cv, "notify_all", lambda: (woken.append(threading.current_thread().name), real())[1])
    at_once, _ = submit(engine, ["what is an embedding?"])
    assert at_once and woken == []
    engine.inline_tokens, saved = 0, engine.inline_tokens  # the same query through the threads still wakes them
    try:
        at_once, _ = submit(engine, ["what is an embedding?"])
    finally:
        engine.inline_tokens = saved
    assert not at_once and woken


def test_busy_engine_big_request_or_slow_forwards_keep_the_threads(engine):
    with Threads(engine.backend) as seen:
        with engine.queue.cv:
            engine._running += 1  # a forward "in progress"
        try:
            async def busy():
                req = engine.submit(["a query while another forward runs"], True, "right")
                assert not req.future.done()
                with engine.queue.cv:  # the pretend forward ends; the threads take the queued query
                    engine._running -= 1
                    engine.queue.cv.notify_all()
                return await asyncio.wait_for(req.future, 30)
            asyncio.run(busy())
        finally:
            with engine.queue.cv:
                engine._running = 0
        # over inline_tokens (64): 4 texts of 20 tokens, tokenized on the loop
        text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
        assert len(engine.tokenizers.tokenizer.encode(text).ids) > engine.inline_tokens // 4
        submit(engine, [text] * 4)
        engine._inline_s = engine_mod.INLINE_MAX_S  # forwards this small got slow: stop blocking the loop
        submit(engine, ["a lone query"], fast=False)
    assert [name.startswith("inference") for name, _ in seen.seen] == [True, True, True]


def test_an_inline_forward_that_fails_is_an_error_answer_and_the_engine_goes_on(engine):
    with Threads(engine.backend, fail=True):
        with pytest.raises(EngineError) as err:
            submit(engine, ["this forward fails"])
    assert err.value.kind == BACKEND and "boom" in str(err.value)
    assert engine._running == 0 and engine.healthy()
    at_once, out = submit(engine, ["and the next one is answered"])
    assert at_once and out[0].shape == (engine.backend.hidden_size,)


def test_the_switch_turns_it_off(monkeypatch):
    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_onnx_dir

    monkeypatch.setenv("EMBEDOPS_INLINE_FORWARD", "0")
    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    assert OrtBackend(info, threads=2).inline_tokens == 0


def _closed_loop(url: str, clients: int, requests_each: int) -> None:
    """`clients` threads, each on its own keep-alive connection, sending `requests_each` queries one after
    another (the bench's closed loop)."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    def client(i):
        with httpx.Client(base_url=url, timeout=30) as c:
            for j in range(requests_each):
                r = c.post("/embed", json={"inputs": f"client {i} asks question number {j}"})
                assert r.status_code == 200, r.text

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))


def test_under_concurrent_load_queries_are_batched_not_run_one_by_one_on_the_loop(monkeypatch):
    """Found in the bench (int8, c=16 and c=64: one row per forward, half the throughput, in some runs):
    requests that arrive while an inline forward blocks the loop are not queued yet, so each found the engine
    idle and ran inline in turn, for as long as the load lasted. The HTTP server's count of the requests it
    holds keeps them on the threads, batched; a lone query still runs on the loop."""
    from localcluster.models import minilm_onnx_dir

    from .conftest import run_server

    monkeypatch.setattr(engine_mod, "INLINE_MAX_S", 60.0)  # the gate open whatever this machine's speed
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean",
                    num_threads=2) as (url, st):
        engine = st.service.engine
        assert engine.inline_tokens > 0
        with Threads(engine.backend) as lone:
            _closed_loop(url, 1, 10)
        assert [name.startswith("inference") for name, _ in lone.seen] == [False] * 10  # on the loop's thread

        with Threads(engine.backend) as load:
            _closed_loop(url, 16, 25)
        on_loop = [rows for name, rows in load.seen if not name.startswith("inference")]
        rows = sum(r for _, r in load.seen)
        assert rows == 16 * 25
        print(f"16 clients x 25 queries: {len(load.seen)} forwards, {len(on_loop)} on the event loop, "
              f"{rows / len(load.seen):.1f} rows per forward")
        assert len(on_loop) <= 0.1 * 16 * 25  # only when one happened to be the only request held
        assert rows / len(load.seen) >= 2  # batched (one by one on the loop: 1.0)
