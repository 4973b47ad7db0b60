"""How much memory an EmbeddingService's replica needs, from the model's geometry and the spec: pure functions
over embedops_server.sizing (one formula for the operator and the server).

The operator cannot read the model's config.json (it is on a volume or the hub, not in the API server), so the
geometry comes from ``model.geometry`` when set, else from the catalog below (the configs of the models this
project is sized for, matched by the id's last path segment: ``BAAI/bge-m3``, ``/models/bge-m3``). Unknown
models get no estimate: the old fixed defaults apply and the status says why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from embedops_server import sizing

from .spec import EmbeddingServiceSpec

# config.json fields of well-known encoders (hidden, layers, heads, intermediate, vocab, positions, type vocab)
_CATALOG: dict[str, dict] = {
    "bge-m3": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                   vocab_size=250002, max_position_embeddings=8194, type_vocab_size=1, model_type="xlm-roberta"),
    "bge-reranker-v2-m3": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                               intermediate_size=4096, vocab_size=250002, max_position_embeddings=8194,
                               type_vocab_size=1, model_type="xlm-roberta", num_labels=1,
                               architectures=["XLMRobertaForSequenceClassification"]),
    "multilingual-e5-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                  intermediate_size=4096, vocab_size=250002, max_position_embeddings=514,
                                  type_vocab_size=1, model_type="xlm-roberta"),
    "bge-large-en-v1.5": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                              intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
                              type_vocab_size=2),
    "bge-base-en-v1.5": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                             vocab_size=30522, max_position_embeddings=512, type_vocab_size=2),
    "bge-small-en-v1.5": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                              intermediate_size=1536, vocab_size=30522, max_position_embeddings=512,
                              type_vocab_size=2),
    "all-minilm-l6-v2": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                             vocab_size=30522, max_position_embeddings=512, type_vocab_size=2),
    "all-mpnet-base-v2": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                              intermediate_size=3072, vocab_size=30527, max_position_embeddings=514,
                              type_vocab_size=0, model_type="mpnet"),
    "ms-marco-minilm-l-6-v2": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                   intermediate_size=1536, vocab_size=30522, max_position_embeddings=512,
                                   type_vocab_size=2, num_labels=1,
                                   architectures=["BertForSequenceClassification"]),
}
# sentence-transformers' max_seq_length where it is below the position embeddings (the server's default)
_MAX_SEQ = {"all-minilm-l6-v2": 256, "all-mpnet-base-v2": 384, "multilingual-e5-large": 512, "bge-m3": 8192}
ROBERTA_OFFSET = 2  # RoBERTa-style position ids start after pad_token_id + 1
HEADROOM = 1.25  # limit = estimate x this: glibc's arenas, a tokenizer burst, a longer-than-measured tail
MIN_CPU_MEMORY = 1 << 30
# render.TEMPLATE_REVISIONS' revision from which the CPU estimate counts the tokenizers the server holds and int8's
# loading peak (the limit it renders is in the pod template)
ESTIMATE_REVISION = 4
# the revision from which it counts an embedder's /embed_all answers (issue 53: the server holds at most
# sizing.RESPONSES_IN_FLIGHT answers of every token's state, of at most sizing.EMBED_ALL_TOKENS tokens each)
TOKEN_ANSWERS_REVISION = 6
PARALLEL_MAX_WEIGHTS = 200 << 20  # the server's SMALL_SESSION_MAX_BYTES: two forwards side by side below it
MIG_MEMORY_GB = re.compile(r"\.(\d+)gb$")


@dataclass(frozen=True)
class Sizing:
    geometry: sizing.Geometry
    source: str  # "catalog bge-m3" or "model.geometry"
    replica: sizing.Estimate
    prepare: int  # bytes the prepare init container may reach (0: nothing to prepare on this accelerator)
    cache: int  # bytes the ONNX cache volume needs (float32 export + int8 + fused graph)


def _catalog_key(model_id: str) -> str:
    return model_id.rstrip("/").rsplit("/", 1)[-1].lower()


def geometry(spec: EmbeddingServiceSpec) -> tuple[sizing.Geometry, str] | None:
    m = spec.model
    if m.geometry is not None:
        g = m.geometry
        cfg = dict(hidden_size=g.hidden_size, num_hidden_layers=g.layers, num_attention_heads=g.heads,
                   intermediate_size=g.intermediate_size or 4 * g.hidden_size, vocab_size=g.vocab_size,
                   max_position_embeddings=g.max_positions, type_vocab_size=0)
        geo = sizing.Geometry.from_config(cfg)
        if g.parameters:
            geo = sizing.Geometry(g.parameters, *list(geo.__dict__.values())[1:])
        return geo, "model.geometry"
    key = _catalog_key(m.id)
    cfg = _CATALOG.get(key)
    if cfg is None:
        return None
    geo = sizing.Geometry.from_config(cfg)
    longest = _MAX_SEQ.get(key) or cfg["max_position_embeddings"] - (
        ROBERTA_OFFSET if cfg.get("model_type") in ("xlm-roberta", "mpnet") else 0)
    return sizing.Geometry(geo.parameters, geo.layers, geo.hidden, geo.heads, geo.intermediate, geo.vocab,
                           longest), f"catalog {key}"


def runs_onnx(spec: EmbeddingServiceSpec) -> bool:
    """The replica runs ONNX Runtime (CPU, float32 weights or int8): the backend with a graph to prepare."""
    return spec.accelerator.cpu is not None and (spec.model.dtype in (None, "float32"))


def tokenization_workers(cores: int, weights: float) -> int:
    """The server's tokenizer threads (its TOKENIZATION_WORKERS). A large model's forwards take seconds, so one
    keeps up; each holds its own tokenizer, whose memory grows with the vocabulary (~110 MB for XLM-R's 250k
    pieces)."""
    return 1 if weights > PARALLEL_MAX_WEIGHTS else max(1, min(4, cores // 2))


def estimate(spec: EmbeddingServiceSpec, dtype: str, revision: int | None = None) -> Sizing | None:
    """The replica's and the prepare step's peak memory for ``spec`` (``dtype``: what render passes to the
    server), or None for a model of unknown geometry. ``revision``: the pod template revision whose limits it
    sizes (None: the latest). From ESTIMATE_REVISION on it counts the tokenizers the server holds and int8's
    loading peak; the revisions before keep the estimate their pods were given."""
    current = revision is None or revision >= ESTIMATE_REVISION
    found = geometry(spec)
    if found is None:
        return None
    g, source = found
    m, b = spec.model, spec.batching
    longest = min(m.max_input_length or g.max_positions, g.max_positions, b.max_batch_tokens)
    cpu = spec.accelerator.cpu
    if cpu is not None:
        weights_dtype = "int8" if m.quantize else dtype
        weights = g.parameters * sizing.BYTES_PER_PARAMETER[weights_dtype]
        parallel = 2 if cpu.cores > 1 and weights <= PARALLEL_MAX_WEIGHTS and runs_onnx(spec) else 1
        forward = 256 if parallel > 1 else 1024
        if current:  # the workers render/pod.py gives the server and the one its event loop and synchronous uses share
            tokenizers = tokenization_workers(cpu.cores, weights) + 1
        else:  # revisions before 4 counted cores // 2 workers (pod.py gives large models one) and two more
            tokenizers = max(1, min(4, cpu.cores // 2)) + 2
        # ColBERT answers one 1024-float vector per token: a full request's outweigh a forward
        colbert_tokens = b.max_client_batch_size * longest if "colbert" in (m.outputs or []) else 0
        # an embedder's /embed_all: at most EMBED_ALL_TOKENS tokens, and no more than a request can carry
        embed_all = (min(sizing.EMBED_ALL_TOKENS, b.max_client_batch_size * longest)
                     if (revision is None or revision >= TOKEN_ANSWERS_REVISION) and m.detected_task == "embed" else 0)
        replica = sizing.estimate(g, dtype=weights_dtype, device="cpu", max_input_length=longest,
                                  forward_tokens=min(forward, b.max_batch_tokens), parallel_forwards=parallel,
                                  tokenizers=tokenizers, colbert_request_tokens=colbert_tokens,
                                  embed_all_tokens=embed_all, answer_cache_bytes=answer_cache_bytes(spec),
                                  int8_load_peak=sizing.INT8_LOAD_PEAK if current else 0.0)
    else:  # torch on CUDA: the warm-up runs a full max-batch-tokens forward
        replica = sizing.estimate(g, dtype=dtype, device="cuda", max_input_length=longest,
                                  forward_tokens=b.max_batch_tokens, tokenizers=4)
    prepare = cache = 0
    if runs_onnx(spec):
        # a folder without onnx/ is exported from its float32 weights; the operator cannot see which, so
        # it sizes for the export too
        prepare = sizing.prepare_estimate(g, quantize=bool(m.quantize), export=True)
        # the float32 export, and with int8 the quantizer's temporary float32 copy of it (prepare keeps its
        # temporaries on this volume, not in the pod's 2Gi /tmp) and the int8 graphs
        cache = int(g.parameters * (4 + (4 + 2 if m.quantize else 0)) * 1.1) + (64 << 20)
    return Sizing(g, source, replica, prepare, cache)


def answer_cache_bytes(spec: EmbeddingServiceSpec) -> int:
    """The bound of the server's answer cache (spec.answerCache.size; 0: off)."""
    return sizing.parse_quantity(spec.answer_cache.size) if spec.answer_cache else 0


def cpu_memory(spec: EmbeddingServiceSpec, est: Sizing | None) -> str:
    """The CPU replica's memory request and limit: the user's, else the estimate with headroom, else 4Gi."""
    cpu = spec.accelerator.cpu
    assert cpu is not None
    if cpu.memory:
        return cpu.memory
    if est is None:
        return "4Gi"
    return sizing.quantity(max(MIN_CPU_MEMORY, sizing.round_up(int(est.replica.total * HEADROOM))))


def mig_memory(spec: EmbeddingServiceSpec) -> int | None:
    """Bytes of GPU memory a replica's MIG slices hold (profile 1g.10gb: 10 GB each)."""
    mig = spec.accelerator.mig
    if mig is None:
        return None
    found = MIG_MEMORY_GB.search(mig.profile)
    return int(found.group(1)) * 10 ** 9 * mig.count if found else None


def refusal(spec: EmbeddingServiceSpec, est: Sizing | None) -> tuple[str, str] | None:
    """(reason, message) when the spec cannot fit what it asks for: the memory the user set on CPU, or the
    MIG slice. None when it fits or nothing is known about the model."""
    if est is None:
        return None
    need = est.replica
    cpu = spec.accelerator.cpu
    if cpu is not None and cpu.memory:
        have = sizing.parse_quantity(cpu.memory)
        if need.total > have:
            return ("InsufficientMemory",
                    f"{spec.model.id} needs about {need.describe()} per replica with these settings, but "
                    f"accelerator.cpu.memory is {cpu.memory}: raise it to at least "
                    f"{sizing.quantity(sizing.round_up(int(need.total * HEADROOM)))}, or lower "
                    f"model.maxInputLength (attention grows with its square) or use model.quantize int8")
    slice_bytes = mig_memory(spec)
    if slice_bytes is not None and need.total > slice_bytes:
        return ("ExceedsMIGSlice",
                f"{spec.model.id} needs about {need.describe()} of GPU memory per replica, more than "
                f"{spec.accelerator.mig.count} x {spec.accelerator.mig.profile} holds "
                f"({slice_bytes / 10 ** 9:.0f} GB): lower batching.maxBatchTokens or model.maxInputLength, "
                "or ask for a larger profile")
    return None
