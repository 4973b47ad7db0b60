"""The embedding space a server's vectors belong to, as one short fingerprint.

An index only works while every vector in it, and every query vector compared with it, comes from the same space.
The fingerprint changes with everything that moves vectors beyond noise and with nothing else, measured side by
side on real servers (`python -m bench.space`, docs/server.md "The embedding space"):

- the model's content: its weights (safetensors or .bin shards, else the ONNX graph the folder ships), config,
  tokenizer, sentence-transformers pooling and Dense modules, bge-m3's heads. Read, not trusted from a name or a
  path: the same weights under another path or commit give the same fingerprint on every replica, and a re-synced
  volume with other weights gives another one. Each file contributes its relative path, size and the SHA-256 of
  its first, middle and last MiB (a full hash of 2 GB of weights would cost seconds at every start);
- the resolved pooling, the default prompt, the quantization (int8: cosine 0.989 min with float32 and 9% of
  queries' top hit changed on all-MiniLM-L6-v2, as much as a prompt prefix), the task, and the longest input
  before truncation (a longer limit changes the vectors of long inputs);
- not the dtype (float16: cosine 0.999999 min with float32, bfloat16 0.99993; top-10 overlap 0.999 and 0.996) nor
  the backend (ONNX Runtime and torch at float32 agree to 1.000000), so a GPU query service in float16 and a CPU
  ingestion service in float32 of the same model share one space; nor per-request choices (`normalize`,
  `dimensions`, `prompt_name`, `truncate`, `embedding_type`), which the client makes and stores beside its vectors;
  nor the int8 scale measured at start (core/quantize.py: one factor for every dimension, so int8 vectors made at
  two scales rank alike).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE = 1 << 20  # bytes read at the start, middle and end of each weight file
HEADER = "embedding-space"  # on every response the model answered (router/timing.py)
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
DESCRIBING = ("config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json", "sparse_linear.pt",
              "colbert_linear.pt")


@dataclass(frozen=True)
class EmbeddingSpace:
    fingerprint: str
    inputs: dict = field(default_factory=dict)  # what it was computed from (/info shows them)


def file_digest(path: Path) -> str:
    """SHA-256 of a file whole when small, else of its size and its first, middle and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE:
            h.update(f.read())
        else:
            for offset in (0, size // 2 - SAMPLE // 2, size - SAMPLE):
                f.seek(offset)
                h.update(f.read(SAMPLE))
    return h.hexdigest()


def model_files(folder: Path, onnx_path: Path | None, dense: tuple[Path, ...] = ()) -> list[Path]:
    """The files whose content decides the vectors: the weights (torch's, else the folder's ONNX graph and its
    data), the files that say how they are read, and the Dense modules applied (``dense``: the ones the server
    loaded, --dense-path's included, besides any `N_Dense` folder)."""
    weights = sorted({p for pattern in WEIGHTS for p in folder.glob(pattern)})
    if not weights and onnx_path is not None:
        onnx = Path(onnx_path)
        weights = [onnx] + sorted(onnx.parent.glob(onnx.name + "_data")) + sorted(onnx.parent.glob(onnx.name + ".data"))
    described = [folder / name for name in DESCRIBING if (folder / name).is_file()]
    dense_files = sorted({p for d in [*folder.glob("[0-9]_Dense"), *dense] for p in Path(d).glob("*") if p.is_file()})
    return weights + described + dense_files


def model_digest(folder: Path, onnx_path: Path | None = None, dense: tuple[Path, ...] = ()) -> str:
    h = hashlib.sha256()
    root = folder.resolve()
    for f in model_files(folder, onnx_path, dense):
        try:
            name = str(f.resolve().relative_to(root))
        except ValueError:  # an ONNX graph outside the folder
            name = f.name
        h.update(f"{name}\0{file_digest(f)}\0".encode())
    return h.hexdigest()


def fingerprint(info, *, quantize: str | None, default_prompt: str | None, max_input_length: int) -> EmbeddingSpace:
    """The space of a server of `info` (core.model_info.ModelInfo) with these settings."""
    inputs = {"model": model_digest(info.path, info.onnx_path, tuple(info.dense))[:16], "task": info.task,
              "pooling": info.pooling,
              "prompt": default_prompt or None, "quantize": quantize or None, "max_input_length": max_input_length}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return EmbeddingSpace(digest, inputs)
