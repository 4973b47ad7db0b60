"""The HTTP targets: how to start each server, and the request bodies / response checks of each API."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .models import CACHE
from .procs import Server, free_port

INFINITY_VERSION = "0.0.78"
INFINITY_VENV = Path(os.environ.get("EMBEDOPS_INFINITY_VENV", CACHE / "venv-infinity"))


@dataclass
class Target:
    name: str
    server: Server
    embed_path: str
    rerank_path: str | None
    embed_body: Callable[[Sequence[str]], Any]
    embed_check: Callable[[Any], bool]
    rerank_body: Callable[[str, Sequence[str]], Any] | None = None
    rerank_check: Callable[[Any], bool] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def embed_url(self) -> str:
        return self.server.url + self.embed_path

    @property
    def rerank_url(self) -> str | None:
        return self.server.url + self.rerank_path if self.rerank_path else None


def _tei_embed_check(n: int | None = None):
    def check(resp) -> bool:
        return isinstance(resp, list) and len(resp) > 0 and isinstance(resp[0], list)
    return check


def _tei_rerank_check(resp) -> bool:
    return isinstance(resp, list) and len(resp) > 0 and "score" in resp[0]


def tei_target(name: str, server: Server, rerank: bool) -> Target:
    return Target(
        name, server, "/embed", "/rerank" if rerank else None,
        embed_body=lambda texts: {"inputs": list(texts) if len(texts) != 1 else texts[0]},
        embed_check=_tei_embed_check(),
        rerank_body=(lambda q, texts: {"query": q, "texts": list(texts)}) if rerank else None,
        rerank_check=_tei_rerank_check if rerank else None,
    )


# ---------------------------------------------------------------- embedops

def parse_variant(name: str) -> tuple[str, list[str], dict]:
    """``embedops-onnx+num-threads=1+ort=nospin`` -> ("embedops-onnx", ["--num-threads", "1"], env).

    ``flag=value`` parts become server flags, ``env.NAME=value`` environment variables; ``ort=...`` sets ONNX Runtime session options through
    bench/_patches (an experiment hook: measures a proposed server change without editing the server)."""
    base, *parts = name.split("+")
    args, env = [], {}
    for p in parts:
        k, _, v = p.partition("=")
        if k == "ort":
            env["EMBEDOPS_BENCH_ORT"] = v.replace(";", ",")
        elif k.startswith("env."):  # embedops-torch+env.GOMP_SPINCOUNT=10000: an environment variable
            env[k[4:]] = v
        else:
            args += [f"--{k}"] + ([v] if v else [])
    return base, args, env


def embedops_target(model_dir: Path, backend: str, *, rerank_model: Path | None = None, log_dir: Path,
                    extra_args: Sequence[str] = (), name: str | None = None,
                    max_client_batch_size: int = 64) -> Target:
    exe = shutil.which("embedops-server", path=str(Path(sys.executable).parent)) or shutil.which("embedops-server")
    argv = ([exe] if exe else [sys.executable, "-m", "embedops_server.cli"])
    port = free_port()
    argv += ["--model-id", str(rerank_model or model_dir), "--port", str(port), "--hostname", "127.0.0.1",
             "--backend", backend, "--max-client-batch-size", str(max_client_batch_size), *extra_args]
    name = name or f"embedops-{backend}" + ("-rerank" if rerank_model else "")
    _, vargs, venv = parse_variant(name)
    argv += vargs
    paths = [str(Path(__file__).resolve().parents[1] / "server"), os.environ.get("PYTHONPATH", "")]
    if venv:
        paths.insert(0, str(Path(__file__).resolve().parent / "_patches"))
    env = {"PYTHONPATH": os.pathsep.join(paths), **venv}
    srv = Server(name, argv, port, health="/health", env=env, log_dir=log_dir)
    return tei_target(name, srv, rerank=rerank_model is not None)


# ---------------------------------------------------------------- naive FastAPI + encode()

def naive_target(model_dir: Path, *, rerank_model: Path | None, log_dir: Path) -> Target:
    port = free_port()
    argv = [sys.executable, "-m", "bench.naive_app", "--model-id", str(model_dir), "--port", str(port)]
    if rerank_model:
        argv += ["--rerank-model-id", str(rerank_model)]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    srv = Server("naive-encode", argv, port, health="/health", env=env, log_dir=log_dir)
    return tei_target("naive-encode", srv, rerank=rerank_model is not None)


# ---------------------------------------------------------------- infinity-emb (own venv)

def ensure_infinity_venv(log=print) -> Path:
    """Create ``venv-infinity`` with infinity-emb pinned (idempotent; a marker file records success)."""
    py = INFINITY_VENV / "bin" / "python"
    marker = INFINITY_VENV / f".embedops-ok-{INFINITY_VERSION}"
    if marker.exists() and py.exists():
        return INFINITY_VENV
    log(f"creating {INFINITY_VENV} with infinity-emb=={INFINITY_VERSION} (one-off, a few minutes)")
    base = shutil.which("python3.11") or sys.executable
    if not py.exists():
        subprocess.run([base, "-m", "venv", str(INFINITY_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + [f"infinity-emb[torch,server]=={INFINITY_VERSION}"], check=True)
    subprocess.run([str(py), "-c", "import infinity_emb, torch, transformers"], check=True)
    marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return INFINITY_VENV


def infinity_target(model_dir: Path, *, rerank_model: Path | None, log_dir: Path, batch_size: int = 32,
                    threads: int | None = None) -> Target:
    venv = ensure_infinity_venv()
    port = free_port()
    argv = [str(venv / "bin" / "infinity_emb"), "v2", "--host", "127.0.0.1", "--port", str(port),
            "--model-id", str(model_dir), "--served-model-name", "embed",
            "--engine", "torch", "--batch-size", str(batch_size), "--device", "cpu",
            "--no-bettertransformer"]
    if rerank_model:
        argv += ["--model-id", str(rerank_model), "--served-model-name", "rerank",
                 "--engine", "torch", "--batch-size", str(batch_size), "--device", "cpu",
                 "--no-bettertransformer"]
    # local folders only: no hub, no telemetry
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    srv = Server("infinity", argv, port, health="/health", env=env, log_dir=log_dir, startup_timeout_s=300)
    t = Target(
        "infinity", srv, "/embeddings", "/rerank" if rerank_model else None,
        embed_body=lambda texts: {"model": "embed", "input": list(texts)},
        embed_check=lambda r: isinstance(r, dict) and len(r.get("data", [])) > 0,
        rerank_body=(lambda q, texts: {"model": "rerank", "query": q, "documents": list(texts)})
        if rerank_model else None,
        rerank_check=(lambda r: isinstance(r, dict) and len(r.get("results", [])) > 0) if rerank_model else None,
    )
    return t
