"""CPU forward cost model: padded tokens per forward capped below --max-batch-tokens, length-sorted micro-batches,
per-shape torch threads, ONNX Runtime without a memory arena."""
from __future__ import annotations

import os
import random
import shutil

import pytest

from embedops_server.backends.base import Backend
from embedops_server.cli import parse_args
from embedops_server.core.queue import BatchQueue

from tests.server.queue_support import drain, entries, next_batch
from embedops_server.service import forward_tokens
from embedops_server.settings import Settings


def test_forward_cap_splits_one_request_into_length_sorted_micro_batches():
    random.seed(5)
    lengths = [random.randint(16, 512) for _ in range(32)]
    q = BatchQueue(max_batch_tokens=16384, max_batch_requests=None, forward_tokens=1024)
    assert q.max_batch_tokens == 16384 and q.forward_tokens == 1024  # the TEI budget is untouched
    es = entries(lengths)
    q.put_many(es)
    batches = drain(q)
    assert sorted(e.seq for b in batches for e in b) == sorted(e.seq for e in es)
    for b in batches:
        assert max(e.length for e in b) * len(b) <= 1024
    real = sum(lengths)
    padded = sum(max(e.length for e in b) * len(b) for b in batches)
    assert real / padded >= 0.8  # long texts do not pad short ones


def test_forward_cap_never_blocks_an_input_longer_than_the_cap():
    q = BatchQueue(max_batch_tokens=16384, max_batch_requests=None, forward_tokens=256)
    q.put_many(entries([512, 10, 10]))
    b, _ = next_batch(q)
    assert [e.length for e in b] == [512]  # the oldest goes alone, the short ones follow together
    b, _ = next_batch(q)
    assert [e.length for e in b] == [10, 10]


def test_forward_cap_applies_to_top_up():
    q = BatchQueue(max_batch_tokens=16384, max_batch_requests=None, forward_tokens=128)
    q.put_many(entries([32, 32]))
    batch, _ = next_batch(q)
    q.put_many(entries([32, 32, 32]))
    with q.cv:
        extra, _ = q.top_up(batch)
    assert len(batch) + len(extra) == 4 and len(q) == 1


def test_forward_cap_above_budget_is_the_budget():
    assert BatchQueue(512, None, forward_tokens=4096).forward_tokens == 512
    assert BatchQueue(512, None).forward_tokens == 512


def test_forward_tokens_setting():
    class B(Backend):
        preferred_batch_tokens = 1024

    assert forward_tokens(Settings(), B()) == 1024  # default: the backend's preference
    assert forward_tokens(Settings(max_forward_tokens=300), B()) == 300
    assert forward_tokens(Settings(max_forward_tokens=0), B()) is None  # 0: up to --max-batch-tokens
    assert forward_tokens(Settings(), Backend()) is None
    assert parse_args(["--model-id", "m", "--max-forward-tokens", "2048"], environ={}).max_forward_tokens == 2048
    assert parse_args(["--model-id", "m"], environ={"MAX_FORWARD_TOKENS": "0"}).max_forward_tokens == 0
    assert parse_args(["--model-id", "m"], environ={}).max_forward_tokens is None


def test_torch_cpu_uses_one_thread_for_tiny_forwards():
    from embedops_server.backends import torch_backend as tb

    from embedops_server.settings import Tuning

    b = tb.TorchBackend.__new__(tb.TorchBackend)
    b.threads, b.tuning = 2, Tuning.from_environment({})  # the default switch: 64 padded tokens
    assert b.cpu_threads_for(1, 16) == 1 and b.cpu_threads_for(2, 32) == 1
    assert b.cpu_threads_for(1, 128) == 2 and b.cpu_threads_for(8, 32) == 2


def test_ort_session_has_no_memory_arena_and_a_forward_cap(monkeypatch):
    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_onnx_dir

    monkeypatch.delenv("EMBEDOPS_ORT_ARENA", raising=False)
    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    b = OrtBackend(info, threads=1)
    assert b.session.get_session_options().enable_cpu_mem_arena is False
    assert b.preferred_batch_tokens == 1024 and b.parallel_forwards == 1
    monkeypatch.setenv("EMBEDOPS_ORT_ARENA", "1")
    assert OrtBackend(info, threads=1).session.get_session_options().enable_cpu_mem_arena is True


def test_ort_forwards_side_by_side_are_formed_smaller(monkeypatch):
    """Two 1-thread forwards side by side run batches of 256 padded tokens; one forward keeps 1024."""
    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_onnx_dir

    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    monkeypatch.setenv("EMBEDOPS_ORT_SMALL_TOKENS", "0")  # no latency session: not what this checks
    b = OrtBackend(info, threads=2)
    assert b.parallel_forwards == 2 and b.preferred_batch_tokens == OrtBackend.PARALLEL_BATCH_TOKENS == 256
    assert forward_tokens(Settings(), b) == 256 and forward_tokens(Settings(max_forward_tokens=1024), b) == 1024
    monkeypatch.setenv("EMBEDOPS_ORT_PARALLEL", "0")
    single = OrtBackend(info, threads=2)
    assert single.parallel_forwards == 1 and single.preferred_batch_tokens == 1024


def test_look_ahead_linger_is_bounded_and_only_under_load():
    from embedops_server.core.engine import LINGER_MAX_S, linger_s

    assert linger_s(0.030, 64, 1024, tokenizing=0) == 0  # nothing on its way: run now
    assert linger_s(0.030, 64, 1024, tokenizing=3) == LINGER_MAX_S
    assert linger_s(0.005, 64, 1024, tokenizing=3) == 0.1 * 0.005  # a tenth of a forward at most
    assert linger_s(0.030, 600, 1024, tokenizing=3) == 0  # already past half its budget
    assert linger_s(0.0, 64, 1024, tokenizing=3) == 0  # no forward timed yet


def test_engine_counts_inputs_in_tokenization(minilm_ort):
    import httpx
    from tests.server.conftest import STATES

    r = httpx.post(minilm_ort + "/embed", json={"inputs": ["a", "b", "c"]})
    assert r.status_code == 200
    assert STATES[minilm_ort].service.engine._tokenizing == 0  # every submitted input was accounted back


def test_info_reports_the_forward_cap(minilm_torch, minilm_ort):
    import httpx

    t = httpx.get(minilm_torch + "/info").json()
    assert t["max_batch_tokens"] == 16384 and t["max_forward_tokens"] == 2048
    info = httpx.get(minilm_ort + "/info").json()
    assert info["max_forward_tokens"] == 1024 and info["parallel_forwards"] == 1  # 1 thread: nothing to split


def test_hybrid_dispatches_by_padded_length():
    import numpy as np

    from embedops_server.backends.hybrid import SHORT_MAX_COLS, HybridBackend
    from embedops_server.core.batch import Batch, BatchOutput

    class Fake(Backend):
        def __init__(self, tag, pref=None):
            self.tag, self.preferred_batch_tokens, self.task, self.hidden_size = tag, pref, "embedding", 4

        def forward(self, batch):
            return BatchOutput(np.full((batch.input_ids.shape[0], 1), self.tag, np.float32))

    h = HybridBackend(Fake(1), Fake(2, 2048))
    assert h.preferred_batch_tokens == 2048 and h.device == "cpu"

    def run(rows, cols):
        ids = np.ones((rows, cols), np.int64)
        return h.forward(Batch(ids, ids, ids * 0, np.full(rows, cols))).pooled[0, 0]

    assert run(1, 16) == 1 and run(32, SHORT_MAX_COLS) == 1  # short texts: ONNX Runtime
    assert run(1, SHORT_MAX_COLS + 1) == 2 and run(4, 256) == 2  # long ones: torch


def test_hybrid_server_matches_sentence_transformers(st_model):
    import httpx
    import numpy as np

    from localcluster.models import minilm_dir
    from tests.server.conftest import cosine, run_server

    short, long = "What is the capital of France?", "Embeddings map sentences to vectors. " * 40
    with run_server(model_id=str(minilm_dir()), backend="hybrid") as (url, st):
        assert st.service.backend.name == "hybrid"
        got = np.array(httpx.post(url + "/embed", json={"inputs": [short, long]}).json())
    assert cosine(got, st_model.encode([short, long], normalize_embeddings=True)).min() >= 0.9999


def test_auto_on_cpu_serves_rerankers_with_onnxruntime(reranker_dir):
    from embedops_server.service import make_backend
    from embedops_server.core.model_info import load_model_info

    info = load_model_info(str(reranker_dir), None, "main")
    assert make_backend(Settings(model_id=str(reranker_dir), device="cpu"), info, None).name == "onnxruntime"


def test_the_server_reads_its_switches_once_and_hands_them_to_the_backend(reranker_dir, tmp_path, monkeypatch):
    """Issue 55: `Tuning()` was read from the environment at five places; the server now reads it once at start
    and passes that object on (the ONNX cache too: EMBEDOPS_CACHE read then, not when the backend is built)."""
    from embedops_server.core.model_info import load_model_info
    from embedops_server.service import make_backend
    from embedops_server.settings import Tuning

    tuning = Tuning(ort_parallel=False, cache=str(tmp_path / "cache"))
    monkeypatch.setenv("EMBEDOPS_CACHE", str(tmp_path / "not-this-one"))
    monkeypatch.delenv("ONNX_CACHE", raising=False)  # the suite's shared cache: --onnx-cache would win
    info = load_model_info(str(reranker_dir), None, "main")
    backend = make_backend(Settings(model_id=str(reranker_dir), device="cpu"), info, None, tuning)
    assert backend.tuning is tuning
    # the export went into the cache read at start
    assert str(backend.model_path).startswith(str(tmp_path / "cache")), backend.model_path
    assert not (tmp_path / "not-this-one").exists()


def test_ort_spinning_session_for_tiny_forwards(monkeypatch):
    import numpy as np

    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.batch import Batch
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_onnx_dir

    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    monkeypatch.delenv("EMBEDOPS_ORT_SMALL_TOKENS", raising=False)
    b = OrtBackend(info, threads=2)  # on by default
    opts = b.small_session.get_session_options()
    assert opts.intra_op_num_threads == 2 and opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert b.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    ids = np.array([[101, 7592, 2088, 102]], np.int64)
    batch = Batch(ids, np.ones_like(ids), np.zeros_like(ids), np.array([4]))
    small = b.forward(batch).pooled
    b.small_session = None
    assert np.allclose(small, b.forward(batch).pooled, atol=1e-5)  # same numbers either way
    assert OrtBackend(info, threads=1).small_session is None  # one thread already: nothing to add
    monkeypatch.setenv("EMBEDOPS_ORT_SMALL_TOKENS", "0")
    assert OrtBackend(info, threads=2).small_session is None


def test_ort_parallel_forwards_use_a_one_thread_session(monkeypatch):
    import numpy as np

    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.batch import Batch
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_onnx_dir

    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    monkeypatch.delenv("EMBEDOPS_ORT_PARALLEL", raising=False)
    b = OrtBackend(info, threads=2)
    assert b.parallel_forwards == 2
    opts = b.narrow_session.get_session_options()
    assert opts.intra_op_num_threads == 1 and opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    ids = np.array([[101, 7592, 2088, 102], [101, 2088, 102, 0]], np.int64)
    mask = (ids > 0).astype(np.int64)
    alone = b.forward(Batch(ids, mask, np.zeros_like(ids), mask.sum(1))).pooled
    beside = b.forward(Batch(ids, mask, np.zeros_like(ids), mask.sum(1), parallel=True)).pooled
    assert np.allclose(alone, beside, atol=1e-5)
    assert OrtBackend(info, threads=1).parallel_forwards == 1  # nothing to split
    assert OrtBackend(info, threads=2, parallel=False).narrow_session is None  # the hybrid backend's ORT half
    monkeypatch.setenv("EMBEDOPS_ORT_PARALLEL", "0")
    off = OrtBackend(info, threads=2)
    assert off.parallel_forwards == 1 and off.narrow_session is None


def test_engine_runs_two_forwards_side_by_side_and_answers_everyone(st_model):
    """Under concurrent load two batches are in the backend at once (each marked parallel); a lone request
    is not marked; every answer is the right vector."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import numpy as np

    from localcluster.models import minilm_onnx_dir
    from tests.server.conftest import cosine, run_server

    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean", num_threads=2,
                    max_batch_requests=4) as (url, st):
        engine, backend = st.service.engine, st.service.backend
        assert httpx.get(url + "/info").json()["parallel_forwards"] == 2
        assert engine.workers == 2 and len([t for t in engine._threads if t.name.startswith("inference")]) == 2
        seen, lock, active = [], threading.Lock(), [0, 0]  # (rows, parallel, overlapping)
        real = backend.forward

        def recording(batch):
            with lock:
                active[0] += 1
                active[1] = max(active[1], active[0])
            try:
                time.sleep(0.02)  # widen each forward so that batches overlap whatever the machine's speed
                out = real(batch)
            finally:
                with lock:
                    active[0] -= 1
            seen.append((len(batch.lengths), batch.parallel))
            return out

        backend.forward = recording
        try:
            lone = httpx.post(url + "/embed", json={"inputs": "a lone query"}).json()
            assert seen == [(1, False)]  # alone: all threads, not the parallel session
            texts = [f"sentence number {i} about embeddings" for i in range(40)]
            with ThreadPoolExecutor(20) as pool:
                got = list(pool.map(lambda t: httpx.post(url + "/embed", json={"inputs": t}, timeout=60), texts))
        finally:
            backend.forward = real
    assert all(r.status_code == 200 for r in got)
    vecs = np.array([r.json()[0] for r in got])
    assert cosine(vecs, st_model.encode(texts, normalize_embeddings=True)).min() >= 0.9999
    assert cosine(np.array(lone), st_model.encode(["a lone query"], normalize_embeddings=True)).min() >= 0.9999
    assert active[1] == 2  # two forwards at once, never more
    assert any(p for _, p in seen[1:]) and sum(n for n, _ in seen[1:]) == 40


def test_two_inference_threads_lingering_on_one_look_ahead_batch_both_survive(monkeypatch):
    """Both inference threads can wait on the same look-ahead batch (inputs still in tokenization); the one
    that does not get it must go back to waiting, not die (it did: the server then ran on one thread)."""
    import asyncio

    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core import engine as engine_mod
    from embedops_server.core.model_info import load_model_info
    from embedops_server.core.queue import Entry
    from embedops_server.core.tokenization import TokenizerPool
    from localcluster.models import minilm_onnx_dir

    info = load_model_info(str(minilm_onnx_dir()), "mean", "main")
    backend = OrtBackend(info, threads=2)
    tokenizers = TokenizerPool(str(info.path / "tokenizer.json"), 1)
    engine = engine_mod.Engine(backend, tokenizers, 128, 16384, None, 64, workers=2)
    try:
        monkeypatch.setattr(engine_mod, "LINGER_MAX_S", 0.3)
        loop = asyncio.new_event_loop()
        req = engine_mod.Request(loop, 2, False)
        ids = tokenizers.tokenizer.encode("a look-ahead batch").ids
        entries = [Entry(req, i, ids, [0] * len(ids)) for i in range(2)]
        with engine.queue.cv:
            engine._forward_s = 1.0
            engine._tokenizing = 1  # an input "in tokenization": whoever picks the slot up lingers for it
            engine._slot = (entries, engine._build(entries))
            engine.queue.cv.notify_all()
        result = loop.run_until_complete(asyncio.wait_for(req.future, 10))
        assert len(result) == 2 and all(r.shape == (backend.hidden_size,) for r in result)
        assert engine.healthy()  # both inference threads alive
        loop.close()
    finally:
        engine.close()


@pytest.mark.parametrize("folder", ["onnx", "onnx-hardlinked", "export"])
def test_small_forwards_run_the_fused_graph_with_the_same_outputs(folder, monkeypatch, tmp_path):
    """The spinning small-forward session runs ONNX Runtime's offline BERT fusions (Attention,
    SkipLayerNormalization, ...); it is only used after it matched the plain graph, and gives the same
    embeddings; EMBEDOPS_ORT_FUSE=0 keeps the plain graph. A model folder whose external data file is hard-linked
    (how uv and `cp -al` install it; onnx's loader refuses such a file) is fused all the same."""
    import numpy as np
    import onnx
    import tokenizers

    from embedops_server.backends.ort_backend import OrtBackend
    from embedops_server.core.batch import Batch
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_dir, minilm_onnx_dir

    root = minilm_onnx_dir() if folder.startswith("onnx") else minilm_dir()
    if folder == "onnx-hardlinked":
        linked = tmp_path / "model"
        shutil.copytree(root, linked, copy_function=os.link)
        root, tmp_path = linked, tmp_path / "cache"
        assert any(f.stat().st_nlink > 1 for f in linked.rglob("*.onnx_data"))
    info = load_model_info(str(root), "mean", "main")
    tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.no_padding()
    monkeypatch.delenv("EMBEDOPS_ORT_SMALL_TOKENS", raising=False)
    monkeypatch.delenv("EMBEDOPS_ORT_FUSE", raising=False)
    b = OrtBackend(info, threads=2, cache=str(tmp_path), tokenizer=tok)
    assert b.latency_graph == "fused"
    fused = next(tmp_path.glob("*/*.fused.onnx"))
    ops = [n.op_type for n in onnx.load(str(fused)).graph.node]
    assert ops.count("Attention") + ops.count("MultiHeadAttention") == 6  # one per layer of MiniLM-L6
    enc = tok.encode("Kubernetes operators reconcile custom resources")
    ids = np.array([enc.ids], np.int64)
    batch = Batch(ids, np.ones_like(ids), np.zeros_like(ids), np.array([len(enc.ids)]))
    small = b.forward(batch).pooled
    b.small_session = None
    plain = b.forward(batch).pooled
    assert np.allclose(small, plain, atol=1e-5) and not np.array_equal(small, np.zeros_like(small))
    # --quantize int8: the fused graph's int8 quantization, held to the int8 gate against float32
    q = OrtBackend(info, threads=2, cache=str(tmp_path), tokenizer=tok, quantize="int8")
    assert q.latency_graph == "fused-int8" and next(tmp_path.glob("*/*.fused.int8.onnx"))
    small = q.forward(batch).pooled
    q.small_session = None
    cos = float((small * plain).sum() / (np.linalg.norm(small) * np.linalg.norm(plain)))
    assert cos >= 0.98 and not np.allclose(small, plain, atol=1e-5)  # int8: close to float32, not equal
    monkeypatch.setenv("EMBEDOPS_ORT_FUSE", "0")
    assert OrtBackend(info, threads=2, cache=str(tmp_path), tokenizer=tok).latency_graph == "plain"
