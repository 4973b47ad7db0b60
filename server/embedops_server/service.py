"""Assemble the serving stack from Settings: model info -> backend -> tokenizer workers -> engine."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from . import heap
from .backends.base import Backend, cpu_threads
from .core import quantize
from .core.batch import padded
from .core.cache import AnswerCache
from .core.engine import Engine, EngineStats
from .core.lanes import Lanes
from .core.model_info import (COLBERT, DENSE, EMBEDDER, HEAD_FILES, LEXICAL, NO_TORCH, ModelError, ModelInfo,
                              load_model_info, no_onnx_without_torch, torch_installed)
from .core.space import EmbeddingSpace, fingerprint
from .core.tokenization import TokenizerPool
from .settings import Settings, Tuning

log = logging.getLogger(__name__)


@dataclass
class Service:
    settings: Settings
    info: ModelInfo
    backend: Backend
    engine: Engine
    tokenizers: TokenizerPool
    max_input_length: int
    load_seconds: float
    space: EmbeddingSpace | None = None
    lanes: Lanes | None = None  # the engines by lane (core/lanes.py); `engine` is its interactive lane's
    cache: AnswerCache | None = None  # --answer-cache-bytes (core/cache.py), shared by the lanes' engines
    int8: quantize.Int8Scale | None = None  # the space's int8 scale (core/quantize.py); None: int8 is not served

    def __post_init__(self):
        if self.lanes is None:
            self.lanes = Lanes.one(self.engine)

    def close(self) -> None:
        """Stop every lane's engine threads and the tokenizer pool (closing `engine` alone would leave the batch
        lane's threads running, holding the backend and its memory-mapped model files)."""
        self.lanes.close()


def _cuda_available() -> bool:
    if not torch_installed():  # the ONNX Runtime-only image: no import attempt on its path
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def make_backend(s: Settings, info: ModelInfo, tokenizer, tuning: Tuning | None = None) -> Backend:
    """The backend ``s`` asks for. ``tuning``: the EMBEDOPS_* switches the server read at its start (default: the
    environment's now)."""
    tuning = tuning if tuning is not None else Tuning()
    cache = s.onnx_cache or tuning.cache
    device = s.device or ("cuda" if s.backend in ("auto", "torch") and _cuda_available() else "cpu")
    kind = s.backend
    if kind == "auto":
        if device.startswith("cuda") or s.dtype not in (None, "float32"):
            kind = "torch"  # ONNX Runtime here runs float32 only
        elif info.onnx_path is not None or info.has_torch_weights:
            # CPU: ONNX Runtime for every task. Since the export uses eager attention it is also the faster one
            # on long rerank pairs (50 x 287: 1.64 s vs 1.97 s and 1.93 vs 2.57 side by side, docs/bench.md).
            kind = "onnxruntime"
        else:
            raise ModelError(f"{info.path} has no ONNX model and no torch weights")
    threads = s.num_threads or cpu_threads()
    if kind in ("torch", "hybrid") and not torch_installed():
        if s.backend == "auto" and info.onnx_path is None:  # auto picked torch for a CUDA device or a dtype
            raise no_onnx_without_torch(info.path)
        raise ModelError(f"the {kind} backend (device {device}, dtype {s.dtype or 'default'}) needs torch and "
                         f"{NO_TORCH}; use --backend onnxruntime with a float32 model or an image with torch")
    if kind == "hybrid":  # CPU float32 only: Settings refuses any other device, dtype or quantization with it
        if not info.has_torch_weights:
            raise ModelError(f"{info.path} has no torch weights; --backend hybrid needs them")
        from .backends.hybrid import HybridBackend
        from .backends.onnx_export import entry_lock
        from .backends.ort_backend import OrtBackend
        from .backends.torch_backend import TorchBackend

        # one forward at a time here (HybridBackend.parallel_forwards is 1): no side-by-side ORT session
        with entry_lock(info, cache):
            short = OrtBackend(info, threads=threads, cache=cache, tokenizer=tokenizer, parallel=False, tuning=tuning)
        return HybridBackend(short, TorchBackend(info, dtype="float32", device="cpu", threads=threads,
                                                 tokenizer=tokenizer, tuning=tuning))
    if kind in ("onnxruntime", "ort", "onnx"):  # float32 (or int8): Settings refuses another dtype with it
        from .backends.onnx_export import entry_lock
        from .backends.ort_backend import OrtBackend

        try:
            with entry_lock(info, cache):
                return OrtBackend(info, threads=threads, quantize=s.quantize, cache=cache,
                                  int8_min_cosine=s.int8_min_cosine, tokenizer=tokenizer, tuning=tuning)
        except Exception as e:
            # auto only: an architecture the exporter cannot handle still serves, on torch.
            if s.backend != "auto" or s.quantize or not info.has_torch_weights or not torch_installed():
                raise
            log.warning("ONNX Runtime backend unavailable (%s); falling back to torch", e)
    if kind != "torch":
        raise ModelError(f"unknown backend {kind!r}")
    if s.quantize:
        raise ModelError("--quantize int8 is only supported with the ONNX Runtime backend")
    if not info.has_torch_weights:
        raise ModelError(f"{info.path} has no torch weights; use --backend onnxruntime")
    from .backends.torch_backend import TorchBackend

    dtype = s.dtype or ("float16" if device.startswith("cuda") else "float32")
    return TorchBackend(info, dtype=dtype, device=device, threads=threads if device == "cpu" else None,
                        tokenizer=tokenizer, tuning=tuning)


def forward_tokens(s: Settings, backend: Backend) -> int | None:
    """Padded tokens per forward: the flag, else the backend's preference (None = up to max_batch_tokens)."""
    if s.max_forward_tokens is not None:
        return s.max_forward_tokens or None
    return backend.preferred_batch_tokens


def check_outputs(wanted: str | None, info: ModelInfo) -> None:
    """--outputs (the operator passes model.outputs): every output asked for must be one the model gives."""
    asked = [o.strip() for o in (wanted or "").split(",") if o.strip()]
    known = (DENSE, LEXICAL, COLBERT)
    unknown = [o for o in asked if o not in known]
    if unknown:
        raise ModelError(f"--outputs {','.join(unknown)}: not an output (one of {', '.join(known)})")
    have = info.outputs
    missing = [o for o in asked if o not in have]
    if missing:
        files = [HEAD_FILES[o] for o in missing if o in HEAD_FILES]
        why = (f"{info.path} has no {' or '.join(files)}" if files and info.task == EMBEDDER
               else f"a {info.task} model gives none of dense, sparse, colbert")
        raise ModelError(f"--outputs asks for {', '.join(missing)} but {why} (it gives: "
                         f"{', '.join(have) or 'nothing of these'})")


def effective_max_input_length(s: Settings, info: ModelInfo) -> int:
    """The longest input the server accepts before truncating (or refusing) it."""
    max_len = info.max_input_length
    if s.max_input_length is not None:
        # the operator passes model.maxInputLength: it bounds the longest input, the warm-up and with them the
        # attention memory (eager attention holds heads x length^2 scores per layer: 4.3 GB at 8192 tokens)
        if s.max_input_length > max_len:
            raise ModelError(f"--max-input-length {s.max_input_length} exceeds the model's own limit {max_len}")
        max_len = s.max_input_length
    if max_len > s.max_batch_tokens:
        # TEI issue 723: an input longer than the budget could never be batched and hung the queue.
        if not s.auto_truncate:
            raise ModelError(
                f"model max input length {max_len} > --max-batch-tokens {s.max_batch_tokens}; "
                "raise the budget or enable --auto-truncate")
        log.warning("max input length %d clamped to --max-batch-tokens %d", max_len, s.max_batch_tokens)
        max_len = s.max_batch_tokens
    return max_len


def default_prompt(s: Settings, info: ModelInfo) -> str | None:
    """The prompt every input gets unless its request names one."""
    if s.default_prompt_name and s.default_prompt_name not in info.prompts:
        raise ModelError(f"--default-prompt-name {s.default_prompt_name!r} is not one of {sorted(info.prompts)}")
    return info.prompts[s.default_prompt_name] if s.default_prompt_name else s.default_prompt


def space_of(s: Settings, info: ModelInfo) -> EmbeddingSpace:
    """The embedding space this server's vectors belong to (core/space.py)."""
    return fingerprint(info, quantize=s.quantize, default_prompt=default_prompt(s, info),
                       max_input_length=effective_max_input_length(s, info))


def build_service(s: Settings, stats: EngineStats | None = None, tuning: Tuning | None = None) -> Service:
    t0 = time.perf_counter()
    info = load_model_info(s.model_id, s.pooling, s.model_revision, s.dense_path, s.huggingface_hub_cache, s.token)
    max_len = effective_max_input_length(s, info)
    check_outputs(s.outputs, info)
    space = space_of(s, info)
    workers = s.tokenization_workers or max(1, min(64, (os.cpu_count() or 2) - 1))
    tokenizers = TokenizerPool(str(info.path / "tokenizer.json"), workers)
    backend = make_backend(s, info, tokenizers.tokenizer, tuning)
    # what loading freed stays resident in glibc's heap otherwise (heap.py), under the warm-up's peak too
    released = heap.release_free_memory() or 0
    cache = AnswerCache(s.answer_cache_bytes, space.fingerprint) if s.answer_cache_bytes else None
    lanes = make_lanes(s, backend, tokenizers, max_len, stats, cache)
    engine = lanes.primary
    # Warm-up: a full budget on GPU (OOM shows at start, not under load); one max-length input on CPU.
    engine.warmup(s.max_batch_tokens if backend.device != "cpu" else max_len)
    graphs = getattr(backend, "_graphs", None)
    if graphs is not None:  # torch on CUDA: capture the one-query shapes now, not on the first request
        graphs.capture_small(min(max_len, 128))
    int8 = int8_scale(info, backend, tokenizers, default_prompt(s, info), max_len)
    released += heap.release_free_memory() or 0  # and what the warm-up's forward freed
    if released > 0:
        log.info("start-up: %d MiB of freed heap returned to the kernel", released >> 20)
    return Service(s, info, backend, engine, tokenizers, max_len, time.perf_counter() - t0, space, lanes, cache,
                   int8)


def int8_scale(info: ModelInfo, backend: Backend, tokenizers: TokenizerPool, prompt: str | None, max_len: int,
               rows: int = 64) -> quantize.Int8Scale | None:
    """The space's int8 scale, measured at start on the model's own vocabulary words (core/quantize.py) with the
    default prompt, as served: 128 short inputs, a few forwards. None for models that give
    no dense vector, or when the forward fails (int8 is then refused, saying why; the server still serves)."""
    if info.task != EMBEDDER or DENSE not in info.outputs:
        return None
    t0 = time.perf_counter()
    try:
        words = quantize.calibration_words(tokenizers.tokenizer.get_vocab())
        encodings = tokenizers.encode_untruncated([(prompt or "") + w for w in words])
        pooled = []
        for i in range(0, len(encodings), rows):
            chunk = [e.ids[:max_len] for e in encodings[i:i + rows]]
            shape = backend.bucket(len(chunk), max(len(ids) for ids in chunk))
            out = backend.forward(padded(chunk, None, shape, backend.pad_id))
            pooled.append(np.asarray(out.pooled[:len(chunk)], dtype=np.float32))
        scale = quantize.Int8Scale(np.concatenate(pooled))
    except Exception as exc:  # noqa: BLE001 - a start-up extra: the float vectors are served either way
        log.warning("int8 is not served: measuring its scale failed: %s", exc)
        return None
    log.info("int8 scale %.3g measured on %d vocabulary words in %.2f s", scale.scale, len(words),
             time.perf_counter() - t0)
    return scale


def make_lanes(s: Settings, backend: Backend, tokenizers: TokenizerPool, max_len: int,
               stats: EngineStats | None, cache: AnswerCache | None = None) -> Lanes:
    """The engines by lane: one per lane where the backend runs forwards side by side (ONNX Runtime on CPU),
    else one for both, interactive inputs first (core/lanes.py); one FIFO engine with --lanes false."""
    def make(**lane) -> Engine:
        return Engine(backend, tokenizers, max_len, s.max_batch_tokens, s.max_batch_requests,
                      s.max_concurrent_requests, stats, forward_tokens=forward_tokens(s, backend),
                      workers=backend.parallel_forwards, max_token_outputs=s.max_embed_all_tokens, cache=cache,
                      **lane)

    if not s.lanes:
        lanes = Lanes.one(make())
    elif backend.concurrent_lanes:
        lanes = Lanes.separate_engines(make, s.max_concurrent_requests, s.batch_lane_limit, s.batch_lane_nice)
    else:
        lanes = Lanes.one(make(), enabled=True, batch_limit=s.batch_lane_limit)
    lanes.max_token_answers = s.max_token_answers
    return lanes
