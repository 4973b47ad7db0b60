"""ONNX Runtime backend (CPU). Uses the folder's ONNX file, or exports one from the torch weights."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..core.batch import Batch, BatchOutput
from ..core.model_info import EMBEDDER, RERANKER, SPARSE, ModelError, ModelInfo
from ..settings import Tuning
from .base import Backend, pool_numpy, split_tokens
from .dense import apply_numpy, load_dense
from .m3 import OrtHeads, load_heads
from .onnx_export import cache_dir, fuse_for_latency, graph_bytes, model_file, quantize_int8, read_gate, write_gate

log = logging.getLogger(__name__)

# Fixed sentences for the int8 quality gate: varied length, topic and punctuation.
CHECK_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Kubernetes operators reconcile the desired state of custom resources.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "def add(a, b): return a + b",
    "I loved this movie, the acting was superb and the plot kept me guessing until the end.",
    "Embeddings map text to dense vectors so that similar meanings end up close together.",
    "short",
]


SMALL_SESSION_MAX_BYTES = 200 << 20
FUSED_MIN_COSINE = 0.9999  # fused vs plain float32: the same arithmetic reordered (MiniLM: max |diff| ~3e-6)


class _Lazy:
    """A value made on first call (the float32 session: only loaded when a check needs it)."""

    def __init__(self, make):
        self._make, self.value = make, None

    def __call__(self):
        if self.value is None:
            self.value = self._make()
        return self.value


class OrtBackend(Backend):
    name = "onnxruntime"
    # ONNX Runtime runs concurrent Run calls on one session; on CPU a lane's forward gets its cores by priority
    concurrent_lanes = True
    # Measured on 2 Xeon cores, MiniLM-L6 (eager export), 256-token rows per forward: 1 row 8190 tokens/s, 2-4
    # rows ~8960-8990, 8 rows 8550, 16 rows 8290, 32 rows 7100; 512-token rows: 2 rows 7680, 32 rows 2930.
    # Past ~1024 padded tokens the attention intermediates outgrow the caches.
    preferred_batch_tokens = 1024
    # With two 1-thread forwards side by side (parallel_forwards) smaller forwards do better still: on 2 EPYC
    # cores, server side by side with 1024 / 512 / 256: ingestion 4307 / 4625 / 4799 tokens/s, rerank top-50
    # 3473 / 3250 / 3191 ms, mixed 5409 / 5943 / 5920 tokens/s, c=64 147 / 142 / 150 texts/s with p99 743-591 /
    # 619-735 / 587-510 ms (docs/bench.md, 2026-12-01 23:06). A 32-token text costs as little per row at 8 rows
    # as at 16-32 on one thread, and a smaller forward is a shorter wait for the inputs queued behind it.
    PARALLEL_BATCH_TOKENS = 256

    def __init__(self, info: ModelInfo, threads: int | None = None, quantize: str | None = None,
                 cache: str | None = None, int8_min_cosine: float = 0.98, tokenizer=None, parallel: bool = True,
                 tuning: Tuning | None = None):
        import onnxruntime as ort

        self.info = info
        # the EMBEDOPS_ORT_* switches: the server's, read once at its start; built alone, the environment's now
        self.tuning = tuning if tuning is not None else Tuning()
        self.task = info.task
        self.pooling = info.pooling
        self.pad_id = int(info.config.get("pad_token_id") or 0)
        self.fp32_path = model_file(info, cache)
        self._ort = ort
        self.threads = threads
        self.model_path = self.fp32_path
        self.int8_cosine: float | None = None
        reference = _Lazy(lambda: self._session(self.fp32_path))  # float32, for the checks that need it
        if quantize == "int8":
            q = quantize_int8(self.fp32_path, cache_dir(info, cache))
            metric = "min cosine" if self.task in (EMBEDDER, SPARSE) else "min score correlation"
            record = read_gate(q)
            self.session = self._session(q)
            self._inputs = {i.name for i in self.session.get_inputs()}  # the same graph's: one set of names
            if record is not None:
                # measured when this int8 graph was made (the prepare step): the float32 graph is not loaded
                # again to measure it (bge-m3: 2.2 GB more at every start)
                self.int8_cosine = float(record["value"])
                log.info("int8 quality check (recorded when the int8 graph was made): %s %.4f vs float32",
                         metric, self.int8_cosine)
            else:
                self.int8_cosine = self._compare(reference(), self.session, tokenizer)
                log.info("int8 quality check: %s %.4f vs float32", metric, self.int8_cosine)
                write_gate(q, metric, self.int8_cosine)
            if self.int8_cosine < int8_min_cosine:
                raise ModelError(
                    f"int8 model fails the quality gate: {metric} {self.int8_cosine:.4f} < {int8_min_cosine}")
            self.model_path = Path(q)
            self.dtype = "int8"
        else:
            self.session = self._session(self.fp32_path)
            reference.value = self.session
            # every session here (float32, int8, latency) comes from the same graph: one set of input names
            self._inputs = {i.name for i in self.session.get_inputs()}
        # Tiny forwards (one short query) on a second session whose threads spin-wait: the main session's threads
        # sleep between parallel operators (see _session) and waking them costs ~1 ms per 16-token text (MiniLM-L6,
        # 2 cores: 3.4 -> 2.5 ms). Spinning for a few-ms forward costs little; for big batches it would steal
        # the cores tokenization and the event loop need. Costs a second copy of the weights, so only for
        # models up to SMALL_SESSION_MAX_BYTES on disk. EMBEDOPS_ORT_SMALL_TOKENS=0 turns it off.
        self.small_tokens = self.tuning.ort_small_tokens
        self.small_session = None
        # the graph file and its external data: bge-m3's own onnx/model.onnx is 0.7 MB beside 2.2 GB of data
        self.model_bytes = graph_bytes(self.model_path)
        small_model = self.model_bytes <= SMALL_SESSION_MAX_BYTES
        self.latency_graph = "off"
        if self.small_tokens > 0 and (threads or 1) > 1 and small_model:
            self.small_session = self._latency_session(info, cache, tokenizer, reference, int8_min_cosine)
        del reference
        # A lone query's forward (the spinning session's sizes) may run on the event loop's thread: its two
        # thread hops cost ~0.3 ms of a 2-4 ms answer (docs/bench.md). EMBEDOPS_INLINE_FORWARD=0 turns it off.
        if self.small_session is not None and self.tuning.inline_forward:
            self.inline_tokens = self.small_tokens
        # Two forwards side by side under load, each on half the threads, in a session of their own (ORT runs
        # concurrent Run calls on one session). A small model's operators are too short to keep two threads busy
        # between barriers: on 2 cores, two 1-thread forwards of 8 x 32 tokens do 362-371 texts/s against 277-305
        # for one 2-thread forward (334 for two concurrent Runs on the 2-thread session, which also lost 16% on
        # long inputs). A forward that runs alone keeps every thread (1 x 512: 76 ms vs 126 on one). Server side
        # by side: c=16 +7.5-15%, c=64 +7-10%, mixed +4-7%, ingestion 0-6%, c=1 unchanged. Costs a copy of the
        # weights and two forwards' buffers (MiniLM: RSS ~650-720 MB under load vs ~450), so small models only.
        # EMBEDOPS_ORT_PARALLEL=0 turns it off.
        self.narrow_session = None
        if parallel and (threads or 1) > 1 and small_model and self.tuning.ort_parallel:
            self.parallel_forwards = 2
            self.narrow_session = self._session(self.model_path, threads=max(1, threads // 2))
            self.preferred_batch_tokens = self.PARALLEL_BATCH_TOKENS
            # A float32 forward that started alone (all threads) is not joined by a narrow one: that would be one
            # more compute thread than cores, and the wide forward's threads meet at a barrier after every
            # operator. Side by side (docs/bench.md, two runs): float32 c=16 p99 -5 to -12%, c=64 -3 to -18%;
            # int8 forwards are half as long, and holding the next batch back for one cost c=16 3-7% of its
            # throughput, so int8 keeps starting a second forward at once. EMBEDOPS_ORT_WIDE_ALONE=1/0 forces it.
            wide = self.tuning.ort_wide_alone
            self.wide_alone = wide if wide is not None else self.dtype != "int8"
        self.hidden_size = int(info.config.get("hidden_size") or self.session.get_outputs()[0].shape[-1] or 0)
        self.dense = load_dense(info.dense) if info.dense else []  # sentence-transformers Dense projections
        if self.dense:
            self.hidden_size = self.dense[-1].out_features
        # bge-m3 heads: small float32 sessions (also under --quantize int8) over the graph's token states
        self.heads = load_heads(info, tokenizer, self.hidden_size)
        self._heads = OrtHeads(self.heads, self._session) if self.heads is not None else None

    def _latency_session(self, info: ModelInfo, cache: str | None, tokenizer, reference, int8_min_cosine: float):
        """The spinning small-forward session, on the fused graph (fuse_for_latency; under --quantize int8 its
        int8 quantization) when it agrees with float32 on CHECK_TEXTS: the plain float32 graph within
        FUSED_MIN_COSINE (the same arithmetic reordered), or for int8 the int8 gate's own threshold. Otherwise,
        and with EMBEDOPS_ORT_FUSE=0, the graph the other sessions run."""
        plain = self.model_path
        if tokenizer is None or not self.tuning.ort_fuse:
            self.latency_graph = "plain"
            return self._session(plain, spin=True)
        int8 = self.dtype == "int8"
        try:
            fused = fuse_for_latency(self.fp32_path, info, cache_dir(info, cache))
            if fused is not None and int8:
                fused = quantize_int8(fused, cache_dir(info, cache))
        except Exception as exc:  # noqa: BLE001 - an optimizer that cannot read a graph costs speed, not service
            log.warning("graph fusion failed, the small-forward session runs the plain graph: %s", exc)
            fused = None
        if fused is not None:
            session = self._session(fused, spin=True)
            agreement = self._compare(reference(), session, tokenizer)
            needed = int8_min_cosine if int8 else FUSED_MIN_COSINE
            if agreement >= needed:
                log.info("forwards of up to %d padded tokens run the fused graph %s (agreement with float32 "
                         "%.6f)", self.small_tokens, fused.name, agreement)
                self.latency_graph = "fused-int8" if int8 else "fused"
                return session
            log.warning("the fused graph disagrees with float32 (%.6f < %s): small forwards run the plain graph",
                        agreement, needed)
        self.latency_graph = "plain"
        return self._session(plain, spin=True)

    def _session(self, path: Path | bytes, spin: bool | None = None, threads: int | None = None):
        ort = self._ort
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        threads = threads or self.threads
        if threads:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        so.log_severity_level = 3
        # No busy-wait between parallel sections: the spinning threads steal the cores that tokenization and
        # the event loop need (measured on 2 shared cores: +40-50% saturated throughput without it).
        # EMBEDOPS_ORT_SPIN=1 restores ORT's default for dedicated, latency-bound machines.
        if spin is None:
            spin = self.tuning.ort_spin
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        # No CPU memory arena: the arena keeps the buffers of the largest batch ever seen (RSS 853 -> 1247 MB in
        # a soak; 185 -> 2208 MB after one 32 x 512 batch, back to 188 MB without it) and small batches are
        # no slower without it. EMBEDOPS_ORT_ARENA=1 turns it back on.
        so.enable_cpu_mem_arena = self.tuning.ort_arena
        model = path if isinstance(path, bytes) else str(path)  # bytes: a graph built here (bge-m3 heads)
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    def _feed(self, batch: Batch) -> dict:
        feed = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if "token_type_ids" in self._inputs:
            feed["token_type_ids"] = batch.token_type_ids
        return feed

    def _run(self, session, batch: Batch) -> np.ndarray:
        return session.run(None, self._feed(batch))[0]

    def forward(self, batch: Batch) -> BatchOutput:
        if batch.parallel and self.narrow_session is not None:
            session = self.narrow_session
        elif self.small_session is not None and batch.input_ids.size <= self.small_tokens:
            session = self.small_session
        else:
            session = self.session
        out = self._run(session, batch)
        if self.task != EMBEDDER:
            return BatchOutput(out.astype(np.float32, copy=False))
        pooled = pool_numpy(out, batch.attention_mask, batch.lengths, self.pooling)
        if self.dense:
            pooled = apply_numpy(pooled.astype(np.float32, copy=False), self.dense)
        tokens = split_tokens(out, batch.lengths, len(batch.lengths)) if batch.need_tokens else None
        lexical = colbert = None
        if batch.heads and self._heads is not None:
            lexical, colbert = self._heads(batch, out)
        return BatchOutput(np.ascontiguousarray(pooled, dtype=np.float32), tokens, lexical, colbert)

    def _compare(self, a, b, tokenizer) -> float:
        """int8 vs float32 on fixed inputs. Embeddings and SPLADE vectors: the lowest per-row cosine. Scores
        (rerankers: query-passage pairs; classifiers): the lowest per-label correlation across the inputs
        (cosine of the centred score vectors): a one-logit row's own cosine is only its sign."""
        if tokenizer is None:
            raise RuntimeError("int8 quality check needs the tokenizer")
        items = ([(q, t) for q in CHECK_TEXTS[:4] for t in CHECK_TEXTS] if self.task == RERANKER
                 else CHECK_TEXTS)
        encs = tokenizer.encode_batch(items)
        L = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), L), np.int64)
        tti = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)] = e.ids
            tti[i, : len(e.ids)] = e.type_ids
            mask[i, : len(e.ids)] = 1
        if self.pad_id:
            ids[mask == 0] = self.pad_id
        lengths = mask.sum(1)
        batch = Batch(ids, mask, tti, lengths)
        x, y = self._run(a, batch), self._run(b, batch)
        if self.task == EMBEDDER:
            x = pool_numpy(x, mask, lengths, self.pooling)
            y = pool_numpy(y, mask, lengths, self.pooling)
        x = x.reshape(len(encs), -1).astype(np.float64)
        y = y.reshape(len(encs), -1).astype(np.float64)
        if self.task not in (EMBEDDER, SPARSE):  # scores: compare each label's column across the inputs
            x, y = (x - x.mean(0)).T, (y - y.mean(0)).T
        cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1) + 1e-12)
        return float(cos.min())
