"""`embedops-server prepare`: make, once per model revision, everything a CPU server would make at its first
start (the ONNX export, its int8 quantization and the quality gate's result, the fused one-query graph) into
the ONNX cache, then exit. Serving pods that mount that cache load the prepared graph and nothing else: for
bge-m3 int8 that is 0.57 GB of weights instead of the float32 export, quantization and float32 gate session
(several GB at start, minutes on few cores).

The operator runs it as the pod's `prepare` init container, with a memory limit of its own; on a cache volume
that outlives the pod (model.cache) later pods find the entry and it returns in about a second.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import tempfile
import time
from pathlib import Path

from .core.model_info import ModelError, load_model_info
from .settings import Settings, Tuning

log = logging.getLogger(__name__)
PREPARED_FILE = "prepared.json"  # in the cache entry: what was prepared, when, at what cost


def runs_onnx(s: Settings) -> bool:
    """Whether this server would run ONNX Runtime (CPU): the only backend with something to prepare."""
    if s.backend in ("torch",) or (s.device or "cpu").startswith("cuda"):
        return False
    if s.dtype not in (None, "float32"):
        return False
    return True


def prepare(s: Settings, tuning: Tuning | None = None) -> dict:
    """Prepare the cache entry for ``s`` (the server's own settings) and return a summary. ``tuning``: the
    EMBEDOPS_* switches read at the start (default: the environment's now)."""
    tuning = tuning if tuning is not None else Tuning()
    t0 = time.perf_counter()
    from .service import space_of

    info = load_model_info(s.model_id, s.pooling, s.model_revision, s.dense_path, s.huggingface_hub_cache, s.token)
    summary: dict = {"model": str(info.path), "commit": info.commit, "space": space_of(s, info).fingerprint}
    if not runs_onnx(s):
        summary["prepared"] = "nothing (this server runs torch)"
        return summary
    from tokenizers import Tokenizer

    from .backends.onnx_export import cache_dir
    from .service import make_backend

    entry = cache_dir(info, s.onnx_cache or tuning.cache)
    tokenizer = Tokenizer.from_file(str(info.path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    # Two pods starting together on a shared cache: make_backend holds the entry's lock while it makes the files
    # (onnx_export.entry_lock), so one prepares and the other waits, then finds it all made.
    backend = make_backend(s, info, tokenizer, tuning)
    graph = Path(backend.model_path)
    summary.update({
        "prepared": backend.name, "cache_entry": str(entry), "graph": graph.name,
        "graph_bytes": getattr(backend, "model_bytes", None), "dtype": backend.dtype,
        "int8_cosine": getattr(backend, "int8_cosine", None),
        "latency_graph": getattr(backend, "latency_graph", None),
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    })
    del backend
    try:  # written whole or not at all: another pod's prepare may write it too
        with tempfile.NamedTemporaryFile("w", dir=entry, prefix=f".{PREPARED_FILE}.", delete=False) as f:
            f.write(json.dumps(summary, indent=1))
        os.replace(f.name, entry / PREPARED_FILE)
    except OSError:
        pass  # read-only and already prepared: nothing new to record
    return summary


def main(s: Settings, tuning: Tuning | None = None) -> int:
    from .router.server import write_termination_message

    tuning = tuning if tuning is not None else Tuning()
    try:
        summary = prepare(s, tuning)
    except ModelError as e:
        log.error("prepare failed: %s", e)
        write_termination_message(f"prepare failed: {e}", tuning.termination_log)
        return 3
    except Exception as e:  # noqa: BLE001 - out of memory, disk full: say so in the pod's status
        log.exception("prepare failed")
        write_termination_message(f"prepare failed: {type(e).__name__}: {e}", tuning.termination_log)
        return 1
    log.info("prepared %s", json.dumps(summary))
    # the pod's status shows this (init container's termination message): what was made and at what cost
    write_termination_message("prepared " + json.dumps(
        {k: summary.get(k) for k in ("commit", "space", "graph", "int8_cosine", "seconds", "peak_rss_mb")}),
        tuning.termination_log)
    return 0
