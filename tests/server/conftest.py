"""Fixtures: real servers (uvicorn in a thread or a subprocess) on free loopback ports, real models."""
from __future__ import annotations

import os

# 2 shared cores: keep every test process to one intra-op thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import contextlib
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from embedops_server.asgi import listening_socket
from embedops_server.router.app import create_app
from embedops_server.router.server import DrainingServer, server_config
from embedops_server.settings import Settings
from localcluster.models import minilm_dir, minilm_onnx_dir, splade_dir


TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Kubernetes operators reconcile custom resources into running workloads.",
    "a",
    "Embeddings map sentences to vectors; similar meanings land close together. " * 6,
    "Ünïcödé text, emojis 🚀 and 中文字符 are tokenized too.",
    "What is the capital of France?",
    "   leading and trailing spaces   ",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 180.0, state=None, dead=None) -> None:
    """Until GET /health answers 200. ``state``: an in-process app's state (its load error ends the wait);
    ``dead()``: for a server in another process or container, a message once it has exited, else None."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if state is not None and state.load_error:
            raise RuntimeError(state.load_error)
        if dead is not None and (why := dead()):
            raise RuntimeError(why)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


STATES: dict = {}  # base url -> the running app's state, for tests that inspect or fault-inject


@contextlib.contextmanager
def run_server(wait: bool = True, **kw):
    """Start the real app under uvicorn in a background thread; yield (base_url, app_state)."""
    kw.setdefault("num_threads", 1)
    kw.setdefault("tokenization_workers", 1)
    kw.setdefault("hostname", "127.0.0.1")
    settings = Settings(**{"port": free_port(), **kw})  # a caller may name the port (an activator's backend)
    app = create_app(settings)
    config = server_config(app, settings, host="127.0.0.1", timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.fastapi.state.embedops)
    sockets = None
    extra = [p for p in (settings.batch_port, settings.prometheus_port) if p]
    if extra:  # as router/server.py's serve: one server on every port
        sockets = [listening_socket("127.0.0.1", p) for p in (settings.port, *extra)]
    t = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{settings.port}"
    while not server.started:
        time.sleep(0.05)
    if wait:
        wait_healthy(url, state=app.fastapi.state.embedops)
    STATES[url] = app.fastapi.state.embedops
    try:
        yield url, app.fastapi.state.embedops
    finally:
        server.should_exit = True
        t.join(20)


@pytest.fixture(scope="module")
def minilm_tokenizer_pool():
    """The engine's tokenizer pool on MiniLM's tokenizer, one worker (engine tests with stand-in backends)."""
    from embedops_server.core.tokenization import TokenizerPool

    pool = TokenizerPool(str(minilm_onnx_dir() / "tokenizer.json"), 1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def minilm_torch():
    with run_server(model_id=str(minilm_dir()), backend="torch", max_client_batch_size=64) as (url, st):
        yield url


@pytest.fixture(scope="session")
def minilm_ort():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean") as (url, st):
        yield url


@pytest.fixture(scope="session")
def splade():
    with run_server(model_id=str(splade_dir()), backend="torch") as (url, st):
        yield url


@pytest.fixture(scope="session")
def st_model():
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    return SentenceTransformer(str(minilm_dir()), device="cpu")


def build_classifier(path: Path, num_labels: int, seed: int) -> Path:
    """A small random BERT *ForSequenceClassification with MiniLM's tokenizer, saved like a hub folder."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    labels = {0: "LABEL_0"} if num_labels == 1 else {i: n for i, n in enumerate(["negative", "neutral", "positive"][:num_labels])}
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=512, num_labels=num_labels,
                     id2label=labels, label2id={v: k for k, v in labels.items()})
    model = BertForSequenceClassification(cfg).eval()
    # Random init gives near-identical scores; widen the head so ordering is meaningful.
    with torch.no_grad():
        model.classifier.weight.mul_(20)
    model.save_pretrained(path)
    src = minilm_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return path


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory):
    return build_classifier(tmp_path_factory.mktemp("reranker"), 1, seed=1)


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory):
    return build_classifier(tmp_path_factory.mktemp("classifier"), 3, seed=2)


@pytest.fixture(scope="session")
def reranker(reranker_dir):
    with run_server(model_id=str(reranker_dir), backend="torch", api_key="s3cret-key") as (url, st):
        yield url


@pytest.fixture(scope="session")
def classifier(classifier_dir):
    with run_server(model_id=str(classifier_dir), backend="onnxruntime", onnx_cache=str(classifier_dir / "cache")) as (url, st):
        yield url


def cosine(a, b):
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
