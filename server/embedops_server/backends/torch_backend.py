"""torch backend: CPU or CUDA, float32/float16/bfloat16, SDPA attention."""
from __future__ import annotations

import inspect
import logging

from ..core.batch import Batch, BatchOutput
from ..core.model_info import CLASSIFIER, EMBEDDER, RERANKER, SPARSE, ModelInfo
from ..settings import Tuning
from .base import Backend
from .dense import TorchDense, load_dense
from .m3 import colbert_rows, lexical_weights, load_heads

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def load_torch_model(info: ModelInfo, dtype: str = "float32", device: str = "cpu", attention: str = "sdpa"):
    import torch
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    cls = {EMBEDDER: AutoModel, SPARSE: AutoModelForMaskedLM, RERANKER: AutoModelForSequenceClassification,
           CLASSIFIER: AutoModelForSequenceClassification}[info.task]
    kwargs = dict(dtype=getattr(torch, _DTYPES[dtype]))
    try:
        model = cls.from_pretrained(str(info.path), attn_implementation=attention, **kwargs)
    except (ValueError, ImportError) as e:  # architectures without that attention path
        log.warning("%s attention unavailable (%s); using the default attention", attention, e)
        model = cls.from_pretrained(str(info.path), **kwargs)
    return model.eval().to(device)


# CPU: forwards up to this many padded tokens run on one intra-op thread. With OMP_WAIT_POLICY=PASSIVE (set by
# the CLI so idle OpenMP threads leave the cores to the tokenizers and the event loop) each parallel region
# wakes sleeping threads, which costs more than it saves on tiny matrices: one 16-token text 8 ms at 1 thread
# vs 12-13 ms at 2 (MiniLM-L6, 2 shared cores); 2 threads win from ~64-128 padded tokens
# (Tuning.torch_single_thread_tokens, EMBEDOPS_TORCH_SINGLE_THREAD_TOKENS).


# CUDA graphs: small batches are launch-bound (one 32-token query on bert-base: 8.0 ms eager, 0.71 ms replayed
# from a graph on an H200). Batches are padded to a small set of shapes; those up to GRAPH_MAX_TOKENS padded
# tokens and GRAPH_MAX_ROWS rows are captured once (lazily, at most GRAPH_MAX_COUNT) and replayed; bigger
# batches are compute-bound and run eagerly. EMBEDOPS_CUDA_GRAPHS=0 turns capture off.
GRAPH_MAX_ROWS = 32
GRAPH_MAX_TOKENS = 4096
GRAPH_MAX_COUNT = 64
GRAPH_COLS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # ~1.5x steps: <= 33% column padding


def gpu_bucket(rows: int, cols: int) -> tuple[int, int]:
    """Padded shape on GPU: rows to a power of two; columns to GRAPH_COLS when the batch is small enough to be
    replayed from a graph, else to a multiple of 16. Padded rows carry an all-zero mask and are discarded."""
    r = 1 << max(0, rows - 1).bit_length()
    c = next((g for g in GRAPH_COLS if g >= cols), None)
    if c is None or r > GRAPH_MAX_ROWS or r * c > GRAPH_MAX_TOKENS:
        c = (cols + 15) // 16 * 16
    return r, c


def graph_shape(rows: int, cols: int) -> tuple[int, int] | None:
    """The captured-graph shape serving an already-bucketed batch of rows x cols, or None (run eagerly)."""
    if rows > GRAPH_MAX_ROWS or rows & (rows - 1) or cols not in GRAPH_COLS or rows * cols > GRAPH_MAX_TOKENS:
        return None
    return rows, cols


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, info: ModelInfo, dtype: str = "float32", device: str = "cpu", threads: int | None = None,
                 tokenizer=None, tuning: Tuning | None = None):
        import torch

        # the EMBEDOPS_* switches: the server's, read once at its start; built alone, the environment's now
        self.tuning = tuning if tuning is not None else Tuning()
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        if device == "cpu" and dtype == "float16":
            log.warning("float16 on CPU is slow and imprecise; consider float32 or bfloat16")
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.torch = torch
        self.info = info
        self.task = info.task
        self.pooling = info.pooling
        self.dtype = dtype
        self.device = device
        self.model = load_torch_model(info, dtype, device)
        self.pad_id = int(info.config.get("pad_token_id") or 0)
        self.hidden_size = int(info.config.get("hidden_size") or info.config.get("dim") or 0)
        self.dense = None
        if info.dense:  # sentence-transformers Dense projections after pooling
            layers = load_dense(info.dense)
            self.dense = TorchDense(layers, device)
            self.hidden_size = layers[-1].out_features
        # bge-m3 heads (sparse_linear.pt, colbert_linear.pt), float32 on the model's device
        self.heads = load_heads(info, tokenizer, self.hidden_size)
        self._head_w = {}
        if self.heads is not None:
            for name, layer in (("sparse", self.heads.sparse), ("colbert", self.heads.colbert)):
                if layer is not None:
                    self._head_w[name] = (torch.from_numpy(layer.weight).to(device),
                                          None if layer.bias is None else torch.from_numpy(layer.bias).to(device))
        # CPU: tokens/s of MiniLM-L6 at 256-token rows (2 threads): 1 row 5700, 4 rows 7600, 8 rows 7950,
        # 16-32 rows 7400-7600; so ~2048 padded tokens per forward lose nothing and keep latency bounded.
        self.preferred_batch_tokens = 2048 if device == "cpu" else None
        self._uses_tti = "token_type_ids" in inspect.signature(self.model.forward).parameters and int(
            info.config.get("type_vocab_size", 0) or 0) > 0
        self._graphs = None
        if device.startswith("cuda") and self.tuning.cuda_graphs:
            self._graphs = CudaGraphs(self)

    def _compute(self, ids, mask, tti, lengths, heads: bool = False):
        """Tensors in, the pooled / logits tensor out (float32): the part captured in a CUDA graph. With
        ``heads`` (a bge-m3 model): (pooled, token weights or None, ColBERT vectors or None), every head the
        model has."""
        torch = self.torch
        kw = {"input_ids": ids, "attention_mask": mask}
        if self._uses_tti:
            kw["token_type_ids"] = tti
        out = self.model(**kw)
        if self.task in (RERANKER, CLASSIFIER):
            return out.logits.float()
        if self.task == SPARSE:
            return (torch.log1p(torch.relu(out.logits.float())) * mask[..., None]).amax(1)
        pooled = self._pool(out.last_hidden_state, mask, lengths)
        if heads:
            return (pooled, *self._heads(out.last_hidden_state, self._head_w))
        return pooled

    def _heads(self, hidden, which: dict):
        """bge-m3 heads over the token states in float32: ReLU'd token weights [B, L] and ColBERT vectors
        [B, L-1, d] (over the states after the first), None for a head not in ``which``."""
        f = self.torch.nn.functional
        tw = cv = None
        if "sparse" in which:
            tw = self.torch.relu(f.linear(hidden.float(), *which["sparse"])).squeeze(-1)
        if "colbert" in which:
            cv = f.linear(hidden[:, 1:].float(), *which["colbert"])
        return tw, cv

    def _head_output(self, batch: Batch, pooled, tw, cv) -> BatchOutput:
        """Device tensors -> numpy rows (lexical weights as (ids, weights), ColBERT vectors per row)."""
        n = len(batch.lengths)
        lexical = colbert = None
        if tw is not None and "sparse" in batch.heads:
            lexical = lexical_weights(batch.input_ids, tw.cpu().numpy(), batch.lengths, n, self.heads.unused_ids)
        if cv is not None and "colbert" in batch.heads:
            colbert = colbert_rows(cv.cpu().numpy(), batch.lengths, n)
        return BatchOutput(pooled.cpu().numpy(), lexical=lexical, colbert=colbert)

    def _pool(self, hidden, mask, lengths):
        """Sentence vector in float32 (mean accumulates in float32 even for half-precision models), then the
        sentence-transformers Dense layers if the model has them."""
        torch = self.torch
        if self.pooling == "cls":
            pooled = hidden[:, 0].float()
        elif self.pooling == "last-token":
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), (lengths - 1).clamp(min=0)].float()
        else:
            m = mask[..., None].float()
            pooled = (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1)
        return self.dense(pooled) if self.dense else pooled

    def bucket(self, rows: int, cols: int) -> tuple[int, int]:
        if self.device == "cpu":
            return rows, cols
        return gpu_bucket(rows, cols)

    def memory_stats(self) -> dict[str, int] | None:
        if not self.device.startswith("cuda"):
            return None
        cuda = self.torch.cuda
        return {"allocated": int(cuda.memory_allocated(self.device)),
                "reserved": int(cuda.memory_reserved(self.device)),
                "max_allocated": int(cuda.max_memory_allocated(self.device))}

    def cpu_threads_for(self, rows: int, cols: int) -> int:
        """Intra-op threads for a CPU forward of this padded shape."""
        return 1 if rows * cols <= self.tuning.torch_single_thread_tokens else self.threads

    def forward(self, batch: Batch) -> BatchOutput:
        if self._graphs is not None and not batch.need_tokens:
            out = self._graphs.run(batch)
            if out is not None:
                return out
        if self.device == "cpu" and self.threads > 1:
            want = self.cpu_threads_for(*batch.input_ids.shape)
            if self.torch.get_num_threads() != want:
                self.torch.set_num_threads(want)  # cheap: sets OpenMP's team size for the next regions
        return self._forward(batch)

    def _forward(self, batch: Batch) -> BatchOutput:
        torch = self.torch
        n = len(batch.lengths)
        with torch.inference_mode():
            ids = torch.from_numpy(batch.input_ids).to(self.device, non_blocking=True)
            mask = torch.from_numpy(batch.attention_mask).to(self.device, non_blocking=True)
            kw = {"input_ids": ids, "attention_mask": mask}
            if self._uses_tti:
                kw["token_type_ids"] = torch.from_numpy(batch.token_type_ids).to(self.device, non_blocking=True)
            out = self.model(**kw)
            if self.task in (RERANKER, CLASSIFIER):
                return BatchOutput(out.logits.float().cpu().numpy())
            if self.task == SPARSE:
                # SPLADE: max over tokens of log(1 + relu(logits)), padding masked out.
                act = torch.log1p(torch.relu(out.logits.float())) * mask[..., None]
                return BatchOutput(act.amax(1).cpu().numpy())
            hidden = out.last_hidden_state
            lengths = torch.from_numpy(batch.lengths).to(self.device) if self.pooling == "last-token" else None
            if batch.heads and self.heads is not None:
                want = {k: v for k, v in self._head_w.items() if k in batch.heads}
                return self._head_output(batch, self._pool(hidden, mask, lengths), *self._heads(hidden, want))
            pooled_np = self._pool(hidden, mask, lengths).cpu().numpy()
            tokens = None
            if batch.need_tokens:
                h = hidden.float().cpu().numpy()
                tokens = [h[i, : batch.lengths[i]] for i in range(n)]
            return BatchOutput(pooled_np, tokens)


class CudaGraphs:
    """Per-shape CUDA graphs of TorchBackend._compute, captured on first use and replayed.

    Static input tensors are allocated per shape; a batch is copied into them, the graph replayed and the
    output copied back to the host. All graphs share one memory pool. Any capture error turns graphs off
    (eager from then on) rather than failing requests."""

    def __init__(self, backend: TorchBackend):
        self.b = backend
        self.torch = backend.torch
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None
        self.enabled = True

    def run(self, batch: Batch) -> BatchOutput | None:
        shape = graph_shape(*batch.input_ids.shape)
        if not self.enabled or shape is None:
            return None
        heads = bool(batch.heads) and self.b.heads is not None
        if heads:  # a graph that also computes every bge-m3 head the model has
            shape = (*shape, True)
        g = self.graphs.get(shape)
        if g is None:
            if len(self.graphs) >= GRAPH_MAX_COUNT:
                return None
            try:
                g = self.graphs[shape] = self._capture(shape)
            except Exception as e:  # never fail a request over an optimisation
                log.warning("CUDA graph capture of %s failed (%s); running eagerly from now on", shape, e)
                self.enabled = False
                return None
        graph, static_in, static_out = g
        torch = self.torch
        with torch.inference_mode():
            for t, a in zip(static_in, (batch.input_ids, batch.attention_mask, batch.token_type_ids, batch.lengths)):
                t.copy_(torch.from_numpy(a), non_blocking=True)
            graph.replay()
            if heads:
                return self.b._head_output(batch, *static_out)
            return BatchOutput(static_out.cpu().numpy())

    def _capture(self, shape: tuple):
        torch = self.torch
        rows, cols = shape[:2]
        heads = len(shape) > 2
        dev = self.b.device
        with torch.inference_mode():
            ids = torch.zeros((rows, cols), dtype=torch.long, device=dev)
            mask = torch.ones((rows, cols), dtype=torch.long, device=dev)
            tti = torch.zeros((rows, cols), dtype=torch.long, device=dev)
            lengths = torch.full((rows,), cols, dtype=torch.long, device=dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph (lazy inits, autotuning)
                for _ in range(2):
                    self.b._compute(ids, mask, tti, lengths, heads)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.b._compute(ids, mask, tti, lengths, heads)
        log.info("captured a CUDA graph for %d x %d%s", rows, cols, " with the bge-m3 heads" if heads else "")
        return graph, (ids, mask, tti, lengths), out

    def capture_small(self, max_cols: int) -> None:
        """Warm-up: capture the one-query shapes (the latency path) so no first request pays for capture."""
        for c in GRAPH_COLS:
            if c > max_cols or not self.enabled:
                break
            if (1, c) not in self.graphs:
                try:
                    self.graphs[(1, c)] = self._capture((1, c))
                except Exception as e:
                    log.warning("CUDA graph capture failed (%s); running eagerly", e)
                    self.enabled = False
