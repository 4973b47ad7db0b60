"""Backend interface shared by torch and ONNX Runtime, plus numpy pooling used by the ORT path."""
from __future__ import annotations

import os

import numpy as np

from ..core.batch import Batch, BatchOutput


class Backend:
    name = "base"
    dtype = "float32"
    device = "cpu"
    pad_id = 0
    pooling: str | None = None
    hidden_size = 0
    # Padded tokens per forward above which this backend gets no faster per token (CPU: slower, the attention
    # and activations outgrow the caches). None: no preference, batches grow to --max-batch-tokens.
    preferred_batch_tokens: int | None = None
    # Forwards the engine may run at once (see Batch.parallel); more than 1 only where measured to pay.
    parallel_forwards = 1
    # Padded tokens up to which the engine may run a forward on the event loop's own thread when nothing else is
    # queued or running (a lone query): the two thread hops around a millisecond-long forward cost a large part
    # of it. 0: never (a forward that could block the loop for long, or one that must stay on its own thread).
    inline_tokens = 0
    # With parallel_forwards > 1: a forward that starts alone runs on every core, and no other starts beside it
    # until it ends (the cores would be oversubscribed). False: a second forward may join it at once.
    wide_alone = False
    # Two forwards may run at once from two threads, each lane's (core/lanes.py), the batch one's threads at a
    # lower priority. False: one engine serves both lanes, the interactive inputs heading the next forward.
    concurrent_lanes = False

    def bucket(self, rows: int, cols: int) -> tuple[int, int]:
        """Padded shape for a batch. CPU: exact. CUDA: a small set of shapes so captured graphs can be reused."""
        return rows, cols

    def forward(self, batch: Batch) -> BatchOutput:
        raise NotImplementedError

    def memory_stats(self) -> dict[str, int] | None:
        """GPU memory in bytes by kind (allocated, reserved, max_allocated); None on CPU."""
        return None


def pool_numpy(hidden: np.ndarray, mask: np.ndarray, lengths: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last-token":
        return hidden[np.arange(hidden.shape[0]), np.maximum(lengths - 1, 0)]
    m = mask[..., None].astype(hidden.dtype)
    return (hidden * m).sum(1) / np.maximum(m.sum(1), 1.0)


def split_tokens(hidden: np.ndarray, lengths: np.ndarray, n: int) -> list[np.ndarray]:
    return [hidden[i, : lengths[i]] for i in range(n)]


def cpu_threads() -> int:
    """CPUs this process may really use: affinity and the cgroup quota (TEI issue 170: 6x slower when ignored)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)
