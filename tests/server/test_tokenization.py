"""TokenizerPool: small jobs encoded on the submitting thread, big ones on a worker, with the same results."""
from __future__ import annotations

import threading

import pytest
from tokenizers import Tokenizer

from embedops_server.core.errors import VALIDATION
from embedops_server.core.tokenization import INLINE_MAX_CHARS, EncodeJob, TokenizerPool
from localcluster.models import minilm_dir


class Done:
    """An EncodeJob callback that records what it got and on which thread."""

    def __init__(self):
        self.event = threading.Event()
        self.thread = self.result = self.error = None

    def __call__(self, result, error):
        self.thread, self.result, self.error = threading.current_thread().name, result, error
        self.event.set()

    def wait(self):
        assert self.event.wait(10), "the job never finished"
        return self


@pytest.fixture(scope="module")
def pool():
    p = TokenizerPool(str(minilm_dir() / "tokenizer.json"), 1)
    yield p
    p.close()


def test_small_job_is_encoded_on_the_submitting_thread(pool):
    done = Done()
    pool.submit(EncodeJob(["a short query", "and another one"], True, "right", 128, done))
    assert done.event.is_set(), "a small job must be finished when submit returns"
    assert done.thread == threading.current_thread().name and done.error is None
    reference = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    reference.no_padding()  # this tokenizer.json pads to 128; the pool pads nothing
    assert [ids for ids, _ in done.result] == [reference.encode(t).ids for t in ["a short query", "and another one"]]


def test_big_job_goes_to_a_worker_and_encodes_the_same(pool):
    text = "Embeddings map sentences to vectors so that similar meanings land close together. "
    big = [text * 3] * 10  # more texts and more characters than the inline limits
    assert sum(map(len, big)) > INLINE_MAX_CHARS
    done, small = Done(), Done()
    pool.submit(EncodeJob(big, True, "right", 128, done))
    pool.submit(EncodeJob([text * 3], True, "right", 128, small))
    done.wait()
    assert done.thread.startswith("tokenizer-") and done.error is None
    assert small.thread == threading.current_thread().name
    assert done.result[0] == small.result[0]  # the same ids and type ids either way


def test_inline_errors_reach_the_callback(pool):
    done = Done()
    pool.submit(EncodeJob(["one two three four five six"], False, "right", 4, done))
    assert done.event.is_set() and done.result is None
    assert done.error.kind == VALIDATION and "less than 4 tokens" in str(done.error)


def test_second_submitter_falls_back_to_a_worker(pool):
    """The inline tokenizer serves one thread at a time: another thread meanwhile uses the workers."""
    done = Done()
    with pool._inline_lock:
        pool.submit(EncodeJob(["while another thread holds the inline tokenizer"], True, "right", 128, done))
        done.wait()
    assert done.thread.startswith("tokenizer-") and done.error is None


def test_a_failing_callback_is_the_submitters_error_and_frees_the_inline_tokenizer(pool):
    def broken(result, error):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        pool.submit(EncodeJob(["a short query"], True, "right", 128, broken))
    done = Done()
    pool.submit(EncodeJob(["a short query"], True, "right", 128, done))
    assert done.event.is_set() and done.thread == threading.current_thread().name  # inline again: lock released


def test_a_failing_callback_on_a_worker_is_called_once_and_spares_its_batch_mates():
    """Jobs drained together by one worker: the first job's callback raises. It must not be called a second
    time (with an error, after its result), and the other jobs of that batch still get their own results."""
    pool = TokenizerPool(str(minilm_dir() / "tokenizer.json"), 1)
    try:
        calls: list[tuple] = []
        gate = threading.Event()
        text = "Embeddings map sentences to vectors so that similar meanings land close together. " * 4
        big = [text] * 8  # over the inline limits: goes to the worker

        def blocker(result, error):  # holds the single worker so the next jobs queue up and drain together
            gate.wait(10)

        def failing(result, error):
            calls.append((result is not None, error))
            raise RuntimeError("the submitter's callback is broken")

        mates = [Done() for _ in range(3)]
        pool.submit(EncodeJob(big, True, "right", 128, blocker))
        pool.submit(EncodeJob(big, True, "right", 128, failing))
        for d in mates:
            pool.submit(EncodeJob(big, True, "right", 128, d))
        gate.set()
        for d in mates:
            d.wait()
            assert d.error is None and len(d.result) == len(big)
        assert calls == [(True, None)], f"the failing callback was called {len(calls)} times: {calls}"
        # and the worker is still alive for the next job
        again = Done()
        pool.submit(EncodeJob(big, True, "right", 128, again))
        assert again.wait().error is None
    finally:
        pool.close()
