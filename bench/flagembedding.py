"""FlagEmbedding's BGEM3FlagModel in a virtual environment of its own (the reference for bge-m3's dense, sparse
and ColBERT outputs; the parity tests and the bench's inline target use it).

PyPI FlagEmbedding 1.4.2 imports a module transformers 5 removed, so the venv has transformers<5 (and its own
huggingface_hub, tokenizers, datasets). torch is not downloaded again: a .pth file appends the main venv's
site-packages after the side venv's own, so the side venv's transformers wins and torch, numpy, ... come from
the main venv (checked at creation: transformers' version and torch's path). Created once, inside the main
venv (under ~/.cache/embedops outside one; ``EMBEDOPS_FLAG_VENV`` overrides); a marker file records success.

``encode()`` runs ``bench/flagembedding_runner.py`` in that venv as a subprocess; results come back as .npz, and
are kept under ~/.cache/embedops/flagembedding-answers keyed by the model folder's bytes and the request (not when
timing), so the parity tests pay for FlagEmbedding once per machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

FLAG_VERSION = "1.4.2"
CACHE = Path(os.environ.get("EMBEDOPS_CACHE") or Path.home() / ".cache" / "embedops")
# One per main venv (its .pth names the main venv's site-packages: another checkout gets its own). It lives inside
# the main venv, so deleting a checkout (a fresh clone CI ran in) deletes it too; a cache entry per clone once
# piled up 441 MB each on the disk CI needs.
_MAIN = sysconfig.get_paths()["purelib"]
_IN_VENV = sys.prefix != sys.base_prefix
VENV = Path(os.environ.get("EMBEDOPS_FLAG_VENV") or
            (Path(sys.prefix) / f"embedops-flagembedding-{FLAG_VERSION}" if _IN_VENV else
             CACHE / f"venv-flagembedding-{FLAG_VERSION}-{hashlib.sha256(_MAIN.encode()).hexdigest()[:8]}"))
RUNNER = Path(__file__).with_name("flagembedding_runner.py")
# What FlagEmbedding's package import needs beyond the main venv (it imports datasets and peft at import).
REQUIREMENTS = ["transformers>=4.44.2,<5", "huggingface_hub<1", "datasets"]
NO_DEPS = [f"FlagEmbedding=={FLAG_VERSION}", "peft", "accelerate"]


def ensure_venv(log=print) -> Path:
    """The side venv's python (created on first use, ~20 s with uv, a minute with pip; then reused)."""
    py = VENV / "bin" / "python"
    marker = VENV / f".embedops-ok-{FLAG_VERSION}"
    if marker.exists() and py.exists():
        return py
    log(f"creating {VENV} with FlagEmbedding=={FLAG_VERSION} and transformers<5 (one-off)")
    # uv (scripts/setup.sh installs it in the main venv) links the packages from its cache: ~3 s where pip took
    # ~40 s of a core; every fresh clone (CI's) makes this venv again, so that is once per run
    uv = shutil.which("uv", path=str(Path(sys.prefix) / "bin")) or shutil.which("uv")
    if not py.exists():
        base = shutil.which("python3.11") or sys.executable
        subprocess.run([uv, "venv", "-q", "--python", base, str(VENV)] if uv else [base, "-m", "venv", str(VENV)],
                       check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # "zz-": .pth files are processed in name order; its path goes after the side venv's own site-packages.
    Path(site, "zz-embedops-main-venv.pth").write_text(_MAIN + "\n")
    if uv:
        # uv does not see the main venv's packages through the .pth file; pip does: pip resolves what is missing
        # (a dry run, ~3 s), uv installs exactly that
        report = VENV / "pip-report.json"
        subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--dry-run",
                        "--disable-pip-version-check", "--report", str(report), *REQUIREMENTS], check=True)
        missing = [f"{i['metadata']['name']}=={i['metadata']['version']}"
                   for i in json.loads(report.read_text())["install"]]
        subprocess.run([uv, "pip", "install", "-q", "--python", str(py), "--no-deps", *missing, *NO_DEPS],
                       check=True)
    else:
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run(pip + REQUIREMENTS, check=True)
        subprocess.run(pip + ["--no-deps"] + NO_DEPS, check=True)
    check = ("import transformers, torch, sys; from FlagEmbedding import BGEM3FlagModel; "
             "assert transformers.__version__.startswith('4.'), transformers.__version__; "
             f"assert torch.__file__.startswith({_MAIN!r}), torch.__file__; "
             "print(transformers.__version__, torch.__version__)")
    subprocess.run([str(py), "-c", check], check=True)
    marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return py


def encode(model_dir: Path | str, texts: list[str], *, max_length: int = 512, batch_size: int = 32,
           timing_rounds: int = 0, threads: int | None = None) -> dict:
    """BGEM3FlagModel(model_dir, float32, CPU).encode(texts, dense + sparse + ColBERT).

    Returns {"dense": [N, D], "sparse": [{token id: weight}], "colbert": [[n_i, d]]}, plus "seconds" (one
    full encode per round, after one warm-up) when ``timing_rounds`` > 0."""
    request = {"texts": texts, "max_length": max_length, "batch_size": batch_size, "timing_rounds": timing_rounds}
    # Without timings the answer is a function of the folder's bytes and the request: kept under that key, a
    # second run (CI on a warm machine) reads it instead of making the side venv and loading FlagEmbedding (50 s)
    saved = None if timing_rounds else CACHE / "flagembedding-answers" / _answer_key(Path(model_dir), request, threads)
    if saved is not None and (saved / "out.json").exists():
        return _read_answer(saved, len(texts))
    py = ensure_venv()
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps({"model": str(model_dir), **request}))
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        env.pop("PYTHONPATH", None)
        subprocess.run([str(py), str(RUNNER), str(req), tmp], check=True, env=env)
        out = _read_answer(Path(tmp), len(texts))
        if saved is not None:
            staged = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
            for name in ("out.npz", "out.json"):  # out.json last: its presence says the entry is whole
                shutil.copyfile(Path(tmp) / name, staged / name)
            try:
                staged.rename(saved)
            except OSError:  # another process saved the same answer first
                shutil.rmtree(staged, ignore_errors=True)
    return out


def _answer_key(model_dir: Path, request: dict, threads: int | None) -> str:
    """The folder's every file (name and bytes), the request, the thread count and the reference's versions."""
    h = hashlib.sha256(json.dumps([FLAG_VERSION, REQUIREMENTS, NO_DEPS, request, threads]).encode())
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(model_dir)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:24]


def _read_answer(folder: Path, n: int) -> dict:
    z = np.load(folder / "out.npz")
    meta = json.loads((folder / "out.json").read_text())
    return {"dense": z["dense"], "sparse": [{int(k): float(v) for k, v in d.items()} for d in meta["sparse"]],
            "colbert": [z[f"colbert_{i}"] for i in range(n)], "seconds": meta.get("seconds", [])}
