"""CPU: ONNX Runtime for short padded inputs, torch for long ones, one model loaded in both (`--backend hybrid`).

Built when ONNX Runtime ran the SDPA-traced export (MiniLM-L6, 2 Xeon cores: 256-token rows torch 7600-8300
tokens/s vs ORT 5000-6500). With the eager export ORT is as fast on long inputs too (ingestion 8877 vs torch
7388 tokens/s side by side), so `auto` no longer needs this; it stays as an explicit option. Both backends
compute the same outputs (cosine >= 0.9999); only one forward runs at a time (one inference thread), so they
never compete for the cores. The price is memory: torch's libraries and a second copy of the weights."""
from __future__ import annotations

from ..core.batch import Batch, BatchOutput
from .base import Backend

# Padded columns up to which a forward goes to ONNX Runtime.
SHORT_MAX_COLS = 128


class HybridBackend(Backend):
    name = "hybrid"

    def __init__(self, short: Backend, long: Backend, short_max_cols: int = SHORT_MAX_COLS):
        self.short, self.long = short, long
        self.short_max_cols = short_max_cols
        self.task = short.task
        self.pooling = short.pooling
        self.pad_id = short.pad_id
        self.hidden_size = short.hidden_size
        self.heads = getattr(short, "heads", None)
        self.dtype = "float32"
        self.device = "cpu"
        self.preferred_batch_tokens = long.preferred_batch_tokens

    def pick(self, rows: int, cols: int) -> Backend:
        return self.short if cols <= self.short_max_cols else self.long

    def forward(self, batch: Batch) -> BatchOutput:
        return self.pick(*batch.input_ids.shape).forward(batch)
