"""The ceiling: the raw backend forward on the same batches, in this process, no HTTP, no queue.

ONNX Runtime: the same ONNX file the embedops server loads (its own export of the folder when the server
package is importable, else the bundled export), same session options. Torch: ``AutoModel`` + mean pooling
under ``inference_mode``. Each is timed with tokenization included (tokenizers ``encode_batch`` + padding to
numpy, what a server has to do) and excluded (pre-tokenized arrays). Also the in-process
sentence-transformers ``encode()`` (what an application calling the model inline gets).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .loadgen import percentile


def n_threads() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, n)


def server_onnx_file(model_dir: Path) -> Path | None:
    """The ONNX file the embedops server uses for ``model_dir`` (exporting it now if the server would)."""
    try:
        from embedops_server.backends.onnx_export import model_file
        from embedops_server.core.model_info import load_model_info

        return Path(model_file(load_model_info(model_dir)))
    except Exception:
        return None


class Tokenize:
    def __init__(self, tokenizer, pairs: bool = False):
        self.tok = tokenizer
        self.pairs = pairs

    def __call__(self, texts: Sequence) -> dict[str, np.ndarray]:
        encs = self.tok.encode_batch(list(texts), add_special_tokens=True)
        L = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), L), np.int64)
        mask = np.zeros_like(ids)
        tti = np.zeros_like(ids)
        for i, e in enumerate(encs):
            n = len(e.ids)
            ids[i, :n] = e.ids
            mask[i, :n] = 1
            tti[i, :n] = e.type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": tti}


class OrtForward:
    name = "onnx"

    def __init__(self, onnx_file: Path, threads: int | None = None, spinning: bool = True, split: int = 1):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads or n_threads()
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        if not spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.config = f"threads={so.intra_op_num_threads}" + ("" if spinning else ",nospin")
        self.sess = ort.InferenceSession(str(onnx_file), so, providers=["CPUExecutionProvider"])
        # split > 1: the batch's rows cut into `split` parts run concurrently on that session (what the server
        # does with two 1-thread forwards under load), so the ceiling is never below the server's own scheme
        self.split, self._pool = split, None
        if split > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(split)
            self.config += f",split={split}"
        self.inputs = {i.name for i in self.sess.get_inputs()}
        self.file = str(onnx_file)

    def __call__(self, feed: dict[str, np.ndarray]):
        feed = {k: v for k, v in feed.items() if k in self.inputs}
        rows = len(feed["input_ids"])
        if self._pool is not None and rows > 1:
            cuts = np.array_split(np.arange(rows), min(self.split, rows))
            parts = [{k: v[c[0]: c[-1] + 1] for k, v in feed.items()} for c in cuts]
            out = np.concatenate(list(self._pool.map(lambda f: self.sess.run(None, f)[0], parts)))
        else:
            out = self.sess.run(None, feed)[0]
        if out.ndim == 3:  # mean pooling, as the server does
            m = feed["attention_mask"][..., None].astype(out.dtype)
            out = (out * m).sum(1) / np.maximum(m.sum(1), 1.0)
        return out


class TorchForward:
    name = "torch"

    def __init__(self, model_dir: Path, rerank: bool = False, threads: int | None = None,
                 device: str = "cpu", dtype: str = "float32"):
        import torch
        import transformers

        self.threads = threads or n_threads()
        torch.set_num_threads(self.threads)
        self.config = f"threads={self.threads}"
        auto = transformers.AutoModelForSequenceClassification if rerank else transformers.AutoModel
        dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        self.model = auto.from_pretrained(str(model_dir), torch_dtype=dt).to(device).eval()
        self.torch, self.device, self.rerank = torch, device, rerank

    def __call__(self, feed: dict[str, np.ndarray]):
        torch = self.torch
        if torch.get_num_threads() != self.threads:  # another forward in this process changed it
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            t = {k: torch.from_numpy(v).to(self.device) for k, v in feed.items()}
            out = self.model(**t)
            if self.rerank:
                r = out.logits
            else:
                h = out.last_hidden_state
                m = t["attention_mask"].unsqueeze(-1).to(h.dtype)
                r = (h * m).sum(1) / m.sum(1).clamp(min=1)
            if self.device != "cpu":
                torch.cuda.synchronize()
            return r.float().cpu().numpy()


@dataclass
class CeilingResult:
    backend: str
    tokenization: str  # "included" | "excluded"
    batches: int
    texts: int
    tokens: int
    wall_s: float
    p50_ms: float
    p99_ms: float

    @property
    def texts_s(self) -> float:
        return self.texts / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(texts_s=self.texts_s, tokens_s=self.tokens_s, req_s=self.batches / self.wall_s
                 if self.wall_s else 0.0)
        return d


def time_batches(forward: Callable, tokenize: Tokenize, batches: Sequence[Sequence], token_counts:
                 Sequence[int], *, include_tokenization: bool, budget_s: float, max_iters: int = 10_000,
                 warmup: int = 1, backend: str = "") -> CeilingResult:
    """Run ``batches`` in order (cycling) until ``budget_s`` or ``max_iters``; per-batch latency."""
    pre = None if include_tokenization else [tokenize(b) for b in batches]
    for i in range(min(warmup, len(batches))):
        # big batches: warm up on a 4-row slice (same sequence length), not a whole multi-second forward
        forward(tokenize(batches[i][:4] if len(batches[i]) > 8 else batches[i]))
    lat, texts, toks = [], 0, 0
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    i = 0
    while i < max_iters and (i == 0 or time.perf_counter() < deadline):
        k = i % len(batches)
        s = time.perf_counter()
        feed = tokenize(batches[k]) if include_tokenization else pre[k]
        forward(feed)
        lat.append(time.perf_counter() - s)
        texts += len(batches[k])
        toks += token_counts[k]
        i += 1
    wall = time.perf_counter() - t0
    return CeilingResult(backend, "included" if include_tokenization else "excluded", i, texts, toks, wall,
                         percentile(lat, 50) * 1000, percentile(lat, 99) * 1000)


class STEncode:
    """In-process sentence-transformers ``encode()`` (the inline baseline)."""
    name = "st-encode"

    def __init__(self, model_dir: Path, threads: int | None = None, rerank: bool = False):
        import torch

        torch.set_num_threads(threads or n_threads())
        if rerank:
            from sentence_transformers import CrossEncoder

            self.m = CrossEncoder(str(model_dir), device="cpu", num_labels=1)
        else:
            from sentence_transformers import SentenceTransformer

            self.m = SentenceTransformer(str(model_dir), device="cpu")
        self.rerank = rerank
        self.threads = threads or n_threads()

    def encode(self, texts: Sequence):
        import torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.rerank:
            return self.m.predict(list(texts), batch_size=len(texts), show_progress_bar=False)
        return self.m.encode(list(texts), batch_size=len(texts), show_progress_bar=False)


def time_st(st: STEncode, batches: Sequence[Sequence], token_counts: Sequence[int], budget_s: float,
            max_iters: int = 10_000) -> CeilingResult:
    st.encode(batches[0])
    lat, texts, toks = [], 0, 0
    t0 = time.perf_counter()
    i = 0
    while i < max_iters and (i == 0 or time.perf_counter() < t0 + budget_s):
        k = i % len(batches)
        s = time.perf_counter()
        st.encode(batches[k])
        lat.append(time.perf_counter() - s)
        texts += len(batches[k])
        toks += token_counts[k]
        i += 1
    wall = time.perf_counter() - t0
    return CeilingResult("st-encode", "included", i, texts, toks, wall, percentile(lat, 50) * 1000,
                         percentile(lat, 99) * 1000)


class Configured:
    """A forward pinned to one thread setting (torch's thread count is per process: set before each call)."""

    def __init__(self, inner, threads: int):
        self.inner, self.threads = inner, threads
        self.config = f"threads={threads}"

    def __call__(self, feed):
        self.inner.threads = self.threads
        return self.inner(feed)


def calibrate(make: Callable[[dict], Callable], configs: Sequence[dict], tokenize: Tokenize,
              probes: Sequence[Sequence], rounds: int = 2) -> tuple[Callable, dict, dict]:
    """Pick the fastest thread configuration of a raw forward on this machine, now.

    On a shared, oversubscribed CPU, N OpenMP/ORT threads can be many times slower than one (a barrier
    waits for a descheduled thread), so the ceiling is the best configuration, not the default one.
    Configurations are timed alternately, ``rounds`` times, on ``probes`` (a few small and larger
    batches); the smallest total wins. Returns (forward, its config, {config: seconds}).
    """
    fwds = [make(c) for c in configs]
    feeds = [tokenize(p) for p in probes]
    for f in fwds:
        f(feeds[0])
    totals = [0.0] * len(fwds)
    for _ in range(rounds):
        for i, f in enumerate(fwds):
            s = time.perf_counter()
            for feed in feeds:
                f(feed)
            totals[i] += time.perf_counter() - s
    best = min(range(len(fwds)), key=lambda i: totals[i])
    return fwds[best], dict(configs[best]), {str(c): round(t, 4) for c, t in zip(configs, totals)}
