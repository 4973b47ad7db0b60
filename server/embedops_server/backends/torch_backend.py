"""torch backend: CPU or CUDA, float32/float16/bfloat16, SDPA attention."""
from __future__ import annotations

import inspect
import logging


from ..core.engine import Batch, BatchOutput
from ..core.model_info import CLASSIFIER, EMBEDDER, RERANKER, SPARSE, ModelInfo
from .base import Backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def load_torch_model(info: ModelInfo, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    cls = {EMBEDDER: AutoModel, SPARSE: AutoModelForMaskedLM, RERANKER: AutoModelForSequenceClassification,
           CLASSIFIER: AutoModelForSequenceClassification}[info.task]
    kwargs = dict(dtype=getattr(torch, _DTYPES[dtype]))
    try:
        model = cls.from_pretrained(str(info.path), attn_implementation="sdpa", **kwargs)
    except (ValueError, ImportError) as e:  # architectures without an SDPA path
        log.warning("SDPA attention unavailable (%s); using the default attention", e)
        model = cls.from_pretrained(str(info.path), **kwargs)
    return model.eval().to(device)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, info: ModelInfo, dtype: str = "float32", device: str = "cpu", threads: int | None = None):
        import torch

        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        if device == "cpu" and dtype == "float16":
            log.warning("float16 on CPU is slow and imprecise; consider float32 or bfloat16")
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.info = info
        self.task = info.task
        self.pooling = info.pooling
        self.dtype = dtype
        self.device = device
        self.model = load_torch_model(info, dtype, device)
        self.pad_id = int(info.config.get("pad_token_id") or 0)
        self.hidden_size = int(info.config.get("hidden_size") or info.config.get("dim") or 0)
        self._uses_tti = "token_type_ids" in inspect.signature(self.model.forward).parameters and int(
            info.config.get("type_vocab_size", 0) or 0) > 0

    def bucket(self, rows: int, cols: int) -> tuple[int, int]:
        if self.device == "cpu":
            return rows, cols
        # GPU: round to a small set of shapes (powers of two rows, 16-token columns) so that CUDA graphs
        # captured per shape can be replayed; padded rows carry an all-zero mask and are discarded.
        r = 1 << (rows - 1).bit_length()
        c = (cols + 15) // 16 * 16
        return r, c

    def forward(self, batch: Batch) -> BatchOutput:
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
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "last-token":
                lengths = torch.from_numpy(batch.lengths).to(self.device)
                pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), (lengths - 1).clamp(min=0)]
            else:
                m = mask[..., None].float()  # accumulate in float32 even for half-precision models
                pooled = (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1)
            pooled_np = pooled.float().cpu().numpy()
            tokens = None
            if batch.need_tokens:
                h = hidden.float().cpu().numpy()
                tokens = [h[i, : batch.lengths[i]] for i in range(n)]
            return BatchOutput(pooled_np, tokens)
