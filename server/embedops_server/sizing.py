"""Memory a replica needs, from the model's geometry and the serving settings: one formula for the operator
(default requests/limits, refusals, the estimate in status) and bench/sizing.py, which measures the real-size
models beside it.

It lives in the server's package, next to what it models, and is shared with the operator (whose image installs
this package without the server's dependencies): pure arithmetic, no imports beyond the standard library
(tests/unit/test_shared_modules.py holds it to that). The constants are fitted to peaks measured on the real-size models (bench/sizing.py prints the
measured figures beside these estimates; docs/server.md#memory has the table).

A replica's resident memory is

    runtime           Python, the web stack, ONNX Runtime or torch (+ CUDA context on a GPU)
  + tokenizers        one Rust tokenizer per worker thread, plus the one the event loop and the synchronous
                      uses share (core/tokenization.py)
  + weights           parameters x bytes per parameter (int8: one byte each, float32 four, float16 two)
  + the larger of
      activations     the largest forward's live tensors, times the forwards that run side by side,
      + responses     and ColBERT outputs waiting to be sent: one vector per token (bge-m3: 1024 floats),
                      which for a full request outweigh a forward
    and loading       int8 on CPU: ONNX Runtime packs each MatMul's weights into MLAS's layout as it loads,
                      the packed copies beside the originals until those are freed (the server then hands the
                      freed heap back: heap.py)

and the largest forward is the worse of two shapes: the longest accepted input alone (its attention scores
grow with length^2: eager attention holds heads x length^2 scores per layer, 4.3 GB at 8192 tokens) and a full
forward of the per-forward token budget.
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Geometry:
    """An encoder's shape (the fields of its config.json that memory depends on)."""
    parameters: int
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int  # longest input in tokens (model's own limit)

    @classmethod
    def from_config(cls, config: dict, max_input_length: int | None = None) -> "Geometry":
        """From a transformers config.json; the parameter count is computed for BERT-style encoders."""
        h = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        inter = int(config.get("intermediate_size") or 4 * h)
        vocab = int(config["vocab_size"])
        pos = int(config.get("max_position_embeddings") or 512)
        types = int(config.get("type_vocab_size") or 0)
        per_layer = 4 * h * h + 4 * h + 2 * h * inter + inter + h + 4 * h  # attention, FFN, two LayerNorms
        params = (vocab + pos + types) * h + 2 * h + layers * per_layer
        if (config.get("num_labels") or 0) and any(a.endswith("ForSequenceClassification")
                                                   for a in config.get("architectures") or []):
            params += h * h + h + h * int(config.get("num_labels") or 1) + 1  # classifier head
        return cls(params, layers, h, int(config["num_attention_heads"]), inter, vocab,
                   max_input_length or pos)


BYTES_PER_PARAMETER = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0}

# Fitted on 2 cores (bench/sizing.py; docs/server.md#memory). The runtime is what an idle server holds besides
# weights and tokenizers; a tokenizer's memory grows with its vocabulary (XLM-R's 250k-piece Unigram model).
CPU_RUNTIME = 230 * MIB
CUDA_RUNTIME = 600 * MIB  # CUDA context, cuBLAS/cuDNN workspaces (not measured here: no GPU lent yet)
TOKENIZER_BYTES_PER_PIECE = 430  # measured: 110 MB per instance for 250k Unigram pieces
TOKENIZER_BASE = 4 * MIB
# int8 on CPU while loading: the peak above the loaded weights, per byte of them. bge-m3 int8 (0.54 GB graph,
# 2 cores, 2026-12-06): 1223 MiB at the end of loading against 967 once the freed heap was returned (0.47).
INT8_LOAD_PEAK = 0.5
# glibc keeps freed activation buffers mapped for a while (ONNX Runtime without its arena allocates per
# forward): the resident peak runs above the live tensors
ACTIVATION_SLACK = 1.3
# A ColBERT answer is streamed input by input (router/routes_m3.py), so what a request holds is its float32
# token vectors until they are sent, plus one input's JSON: resident bytes per float32 output byte, measured
# with bench/colbert_memory.py (see docs/server.md#memory).
RESPONSE_BYTES_PER_OUTPUT_BYTE = 1.25  # measured 1.02 (two requests, JSON floats), 0.53 (base64)
# Answers of every token's state (ColBERT vectors, /embed_all's hidden states) held at once: the one being sent and
# the one the engine is finishing. The server admits no more (--max-token-answers, core/lanes.py: from admission
# until the answer is handed to the kernel; one more is 429).
RESPONSES_IN_FLIGHT = 2
# The most tokens one /embed_all request may carry (--max-embed-all-tokens; more is 422 before any forward): at
# bge-m3's width, 32 MiB of float32.
EMBED_ALL_TOKENS = 8192
# /embed_all's answer is serialized whole (orjson, numpy arrays): its float32 states and their JSON (11.7 bytes a
# float, measured on all-MiniLM-L6-v2's 3,872 x 384: 17.4 MB) are held together while it is built, then the JSON
# until it is sent. Resident bytes per float32 output byte:
EMBED_ALL_BYTES_PER_OUTPUT_BYTE = 4.0


@dataclass(frozen=True)
class Estimate:
    runtime: int
    tokenizers: int
    weights: int
    activations: int
    detail: str  # which forward shape decided the activations
    responses: int = 0  # ColBERT outputs held while they are sent
    loading: int = 0  # above the weights while they load (int8 on CPU: their packed copies)
    answer_cache: int = 0  # --answer-cache-bytes: held once full, whatever the load

    @property
    def serving(self) -> int:
        """What forwards and answers add to the loaded model."""
        return self.activations + self.responses

    @property
    def total(self) -> int:
        return self.runtime + self.tokenizers + self.weights + self.answer_cache + max(self.serving, self.loading)

    def describe(self) -> str:
        rest = "runtime and tokenizers" if self.tokenizers else "runtime"
        held = f", answers of every token's state {gib(self.responses)}" if self.responses else ""
        load = f"; loading, {gib(self.loading)} above the weights, is the peak" if self.loading > self.serving else ""
        cache = f", answer cache {gib(self.answer_cache)}" if self.answer_cache else ""
        return (f"{gib(self.total)} (weights {gib(self.weights)}, activations {gib(self.activations)} "
                f"for {self.detail}{held}, {rest} {gib(self.runtime + self.tokenizers)}{cache}{load})")


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


def forward_bytes(g: Geometry, rows: int, length: int, bytes_per_value: int = 4, eager_attention: bool = True) -> int:
    """Live tensors of one encoder layer at its peak for ``rows`` x ``length`` padded tokens (the layers run
    one after the other; their outputs replace their inputs). Hidden-sized tensors: the input, the residual,
    query, key, value, context and output (7); two intermediate-sized ones (before and after the activation);
    eager attention: scores and probabilities, rows x heads x length^2 each."""
    tokens = rows * length
    hidden = 7 * tokens * g.hidden
    ffn = 2 * tokens * g.intermediate
    attention = 2 * rows * g.heads * length * length if eager_attention else 2 * tokens * g.hidden
    return (hidden + ffn + attention) * bytes_per_value


def estimate(g: Geometry, *, dtype: str, device: str = "cpu", max_input_length: int | None = None,
             forward_tokens: int = 1024, parallel_forwards: int = 1, tokenizers: int = 3,
             colbert_request_tokens: int = 0, int8_load_peak: float = INT8_LOAD_PEAK,
             embed_all_tokens: int = 0, answer_cache_bytes: int = 0) -> Estimate:
    """Peak resident memory of one serving replica: host memory on CPU, GPU memory on CUDA.

    ``forward_tokens``: padded tokens per forward (CPU: the ONNX Runtime backend's 1024, or 256 per forward
    with two side by side; CUDA: up to max-batch-tokens, which the warm-up runs in full). ``tokenizers``: Rust
    tokenizer instances (the workers + the one the event loop and the synchronous uses share).
    ``int8_load_peak``: int8 on CPU, the loading peak above the weights per byte of them (0: not counted, as
    the operator's template revisions before 4 did). ``colbert_request_tokens``: with
    ColBERT outputs served, the most tokens one request may carry (max client batch size x longest input);
    its vectors (hidden-size floats each, bge-m3's ColBERT head) are host memory, so they count on CPU only:
    on a GPU they are not in the slice. ``embed_all_tokens``: an embedder's /embed_all answer, at most this many tokens
    (0: not counted, as the operator's template revisions before 6 did); host memory too. The server holds
    RESPONSES_IN_FLIGHT answers of either kind at once, so the larger of the two counts that many times.
    ``answer_cache_bytes``: the answer cache's bound (host memory: not counted on CUDA)."""
    length = min(max_input_length or g.max_positions, g.max_positions)
    cuda = device.startswith("cuda")
    value_bytes = 2 if cuda and dtype in ("float16", "bfloat16") else 4  # int8 dynamic: float32 activations
    # torch on CUDA runs SDPA (flash / memory-efficient kernels): no length^2 score matrix
    eager = not cuda
    longest = forward_bytes(g, 1, length, value_bytes, eager)
    rows = max(1, forward_tokens // length)
    full = forward_bytes(g, rows, min(length, forward_tokens), value_bytes, eager)
    if full >= longest:
        act, detail = full, f"{rows} x {min(length, forward_tokens)} tokens per forward"
    else:
        act, detail = longest, f"one {length}-token input"
    act = int(act * parallel_forwards * (1.0 if cuda else ACTIVATION_SLACK))
    if parallel_forwards > 1:
        detail += f", {parallel_forwards} forwards side by side"
    weights = int(g.parameters * BYTES_PER_PARAMETER[dtype])
    # On CUDA the estimate is the GPU's memory (what a MIG slice must hold): the tokenizers and Python live in
    # the pod's host memory, not on the device
    tok = 0 if cuda else tokenizers * (TOKENIZER_BASE + TOKENIZER_BYTES_PER_PIECE * g.vocab)
    answer = max(colbert_request_tokens * g.hidden * 4 * RESPONSE_BYTES_PER_OUTPUT_BYTE,
                 embed_all_tokens * g.hidden * 4 * EMBED_ALL_BYTES_PER_OUTPUT_BYTE)
    held = 0 if cuda else int(RESPONSES_IN_FLIGHT * answer)
    loading = int(weights * int8_load_peak) if dtype == "int8" and not cuda else 0
    return Estimate(CUDA_RUNTIME if cuda else CPU_RUNTIME, tok, weights, act, detail, held, loading,
                    0 if cuda else answer_cache_bytes)


# The one-time preparation, in float32 copies of the weights at its peak (measured on bge-m3's 2.27 GB: the
# export from safetensors 5.0 GB, holding the torch weights and the traced graph, then the graph for packing;
# ONNX Runtime's quantizer 8.6 GB, holding the float32 graph, numpy copies of each weight and the int8
# result while it serializes; the gate 2.2 GB, a float32 session over memory-mapped external data beside the
# int8 one).
PREPARE_FLOAT32_COPIES = {"export": 2.2, "quantize": 3.8, "gate": 1.0}


def prepare_estimate(g: Geometry, *, quantize: bool, export: bool) -> int:
    """Peak resident memory of `embedops-server prepare` for this model (the largest of its steps)."""
    fp32 = g.parameters * 4
    steps = []
    if export:
        steps.append(PREPARE_FLOAT32_COPIES["export"] * fp32)
    if quantize:
        steps.append(PREPARE_FLOAT32_COPIES["quantize"] * fp32)
        steps.append(PREPARE_FLOAT32_COPIES["gate"] * fp32 + g.parameters)
    return int(max(steps, default=0) + CPU_RUNTIME + TOKENIZER_BASE + TOKENIZER_BYTES_PER_PIECE * g.vocab)


def round_up(n: int, step: int = 256 * MIB) -> int:
    return -(-n // step) * step


def quantity(n: int) -> str:
    """A Kubernetes quantity of at least ``n`` bytes, in the API server's canonical form (the largest binary
    suffix that keeps it whole: 2Gi, not 2048Mi, which a stored object would show instead, so the status and the
    pod would disagree)."""
    mib = -(-n // MIB)
    for suffix, size in (("Ti", 1 << 20), ("Gi", 1 << 10)):
        if mib % size == 0:
            return f"{mib // size}{suffix}"
    return f"{mib}Mi"


def parse_quantity(q: str) -> int:
    """Bytes of a Kubernetes memory quantity (Ki, Mi, Gi, Ti, k, M, G, T, plain bytes)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10 ** 3, "M": 10 ** 6,
             "G": 10 ** 9, "T": 10 ** 12, "m": 1e-3}
    q = str(q).strip()
    for suffix in sorted(units, key=len, reverse=True):
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * units[suffix])
    return int(float(q))
