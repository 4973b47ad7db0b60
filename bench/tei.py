"""Hugging Face text-embeddings-inference (TEI) as a bench peer: ``tei``, ``tei+int8``, ``tei+fused``, ``tei-candle``.

TEI 1.9.3's ``text-embeddings-router`` is built from source by the kit in ``../shared/tei`` (its README; CPU
features of TEI's own image: ``ort,candle,mkl,static-linking,http``) into ``~/.cache/tei-peer`` (override:
``EMBEDOPS_TEI_HOME``). The bench never builds it on its own: ``python -m bench.tei build`` (or ``python -m
bench --build-tei``) runs the kit once, cached; without a build the TEI targets are skipped with one line.

- ``tei``: TEI's ONNX Runtime backend, on a folder holding the model's config/tokenizer files and
  ``onnx/model.onnx`` = the very float32 graph embedops runs (``embedops_server.backends.onnx_export``), so the
  forward is like for like. The weights are left out of that folder: TEI falls back to candle silently when
  its ORT backend cannot start, and without weights it fails loudly instead.
- ``tei+int8`` (also ``tei+quantize=int8``): the same, with the int8 graph embedops makes for
  ``--quantize int8`` (``quantize_int8`` of that float32 file). TEI has no quality gate of its own.
- ``tei+fused`` (``tei+int8+fused``): the same, with the fused graph embedops runs for one-query forwards
  (ONNX Runtime's offline BERT fusions, ``fuse_for_latency``; its int8 quantization) for every TEI forward:
  what TEI does given that graph.
- ``tei-candle``: TEI's candle backend (MKL) on the model folder itself (it has no ONNX file).
- ``+flag=value`` parts become router flags (``tei+max-batch-requests=4``).

Every instance gets its own ``--port`` and ``--prometheus-port`` (TEI's metrics listener defaults to 9000, so
two instances would collide), ``--max-client-batch-size 64`` like embedops (TEI's default 32 refuses the
50-passage rerank request) and ``--model-id`` a local folder (``HF_HUB_OFFLINE=1`` from ``run-tei``).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .models import CACHE
from .procs import Server, free_port

TEI_VERSION = "1.9.3"
BASES = {"tei": "ort", "tei-candle": "candle"}
REPO = Path(__file__).resolve().parents[1]
# files of a model folder that the ORT folder links (weights are left out on purpose, see above)
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".h5", ".msgpack", ".ckpt")


class TeiUnavailable(RuntimeError):
    """TEI cannot run here; the message is one line saying why and what to do."""


def tei_home() -> Path:
    if os.environ.get("EMBEDOPS_TEI_HOME"):
        return Path(os.environ["EMBEDOPS_TEI_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tei-peer"


def kit_dir() -> Path:
    return Path(os.environ.get("EMBEDOPS_TEI_KIT") or REPO.parent / "shared" / "tei")


def runner_path(home: Path | None = None) -> Path:
    """The kit's wrapper (sets LD_LIBRARY_PATH for MKL's libiomp5 and libonnxruntime, HF_HUB_OFFLINE=1)."""
    return (home or tei_home()) / "run-tei"


def unavailable_reason(home: Path | None = None) -> str | None:
    """None when the kit's build is there, else one line: why not, and the command that builds it."""
    home = home or tei_home()
    run, binary = runner_path(home), home / "bin" / "text-embeddings-router"
    if run.is_file() and os.access(run, os.X_OK) and binary.is_file():
        return None
    return (f"TEI {TEI_VERSION} is not built ({run} missing); build it once with "
            f"`python -m bench.tei build` (the kit in {kit_dir()}, ~12+ min)")


# ---------------------------------------------------------------- target names

@dataclass
class TeiSpec:
    name: str
    backend: str                 # "ort" | "candle"
    quantize: str | None = None  # "int8": the int8 graph embedops makes
    flags: list[str] = field(default_factory=list)
    fused: bool = False          # the fused graph embedops' one-query forwards run (onnx_export.fuse_for_latency)


def is_tei(name: str) -> bool:
    return name.split("+")[0] in BASES


def parse_tei(name: str) -> TeiSpec:
    """``tei+int8+max-batch-requests=4`` -> TeiSpec("...", "ort", "int8", ["--max-batch-requests", "4"])."""
    base, *parts = name.split("+")
    if base not in BASES:
        raise ValueError(f"not a TEI target: {name!r} (one of {sorted(BASES)}, with +int8 / +flag=value)")
    spec = TeiSpec(name, BASES[base])
    for p in parts:
        k, eq, v = p.partition("=")
        if p in ("int8", "quantize=int8"):
            spec.quantize = "int8"
        elif p == "fused":
            spec.fused = True
        elif k == "quantize":
            raise ValueError(f"{name}: only quantize=int8 is known")
        elif not k:
            raise ValueError(f"{name}: empty part")
        else:
            spec.flags += [f"--{k}"] + ([v] if eq else [])
    if (spec.quantize or spec.fused) and spec.backend != "ort":
        raise ValueError(f"{name}: int8 and fused are ONNX graphs, i.e. TEI's ORT backend (`tei+int8`, `tei+fused`)")
    return spec


def peer_for(embedops_target: str) -> str:
    """The TEI target that runs the same graph as an embedops target: int8 against ``tei+int8``."""
    parts = embedops_target.split("/")[0].split("+")[1:]
    return "tei+int8" if ("quantize=int8" in parts or "int8" in parts) else "tei"


# ---------------------------------------------------------------- model folders

def onnx_for(model_dir: Path, quantize: str | None, fused: bool = False) -> Path:
    """The ONNX file the embedops server runs for ``model_dir`` (exported now if need be), int8 if asked, or
    the fused graph of its small forwards (the plain one when the model has none)."""
    from embedops_server.backends.onnx_export import cache_dir, fuse_for_latency, model_file, quantize_int8
    from embedops_server.core.model_info import load_model_info

    info = load_model_info(model_dir)
    fp32 = Path(model_file(info))
    graph = fp32
    if fused:
        graph = Path(fuse_for_latency(fp32, info, cache_dir(info, None)) or fp32)
    if quantize == "int8":
        graph = Path(quantize_int8(graph, cache_dir(info, None)))
    return graph


def ort_folder(model_dir: Path, onnx_file: Path, root: Path | None = None) -> Path:
    """A folder for TEI's ORT backend: ``model_dir``'s config and tokenizer files (symlinks; ``1_Pooling/``
    etc. too), no weights, and ``onnx/model.onnx`` -> ``onnx_file`` (with its external data files beside it).
    Rebuilt each call (cheap)."""
    model_dir, onnx_file = Path(model_dir).resolve(), Path(onnx_file).resolve()
    key = hashlib.sha256(f"{model_dir}\0{onnx_file}".encode()).hexdigest()[:12]
    out = (root or CACHE / "tei-models") / f"{model_dir.name}-{onnx_file.stem}-{key}"
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.rglob("*"):
        rel = f.relative_to(model_dir)
        if f.is_dir() or rel.parts[0] == "onnx" or f.name.endswith(WEIGHTS):
            continue
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).symlink_to(f)
    (tmp / "onnx").mkdir()
    (tmp / "onnx" / "model.onnx").symlink_to(onnx_file)
    # a graph with external data (bge-m3's onnx/model.onnx_data, exports over 2 GB): ONNX Runtime looks for
    # those files beside the path it was given, so they are linked under the names the graph records
    from embedops_server.backends.onnx_export import graph_files

    for f in graph_files(onnx_file):
        if f == onnx_file:
            continue
        (tmp / "onnx" / f.name).symlink_to(f.resolve())
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------- servers

class TeiServer(Server):
    """TEI 1.9.3 answers /metrics on its API port; the separate ``--prometheus-port`` listener is only a
    fallback here (its router builds that exporter but does not run it; the port must still be free)."""

    def __init__(self, *a, prometheus_port: int, **kw):
        super().__init__(*a, **kw)
        self.prometheus_port = prometheus_port

    def get(self, path: str, timeout: float = 5.0) -> str | None:
        got = super().get(path, timeout)
        if got is None and path == "/metrics":
            import urllib.request

            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.prometheus_port}/metrics",
                                            timeout=timeout) as r:
                    return r.read().decode(errors="replace")
            except Exception:
                return None
        return got


def two_ports() -> tuple[int, int]:
    a = free_port()
    for _ in range(20):
        b = free_port()
        if b != a:
            return a, b
    raise RuntimeError("no second free port")


def tei_argv(run: Path, model: Path, port: int, prometheus_port: int, flags=(),
             max_client_batch_size: int = 64) -> list[str]:
    return [str(run), "--model-id", str(model), "--hostname", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(prometheus_port), "--max-client-batch-size", str(max_client_batch_size),
            *flags]


def tei_target(name: str, model_dir: Path, *, rerank_model: Path | None = None, log_dir: Path,
               home: Path | None = None):
    """The Target of a TEI name (raises TeiUnavailable, one line, when the build is absent)."""
    from .targets import tei_target as api_target  # TEI's own API: /embed, /rerank

    spec = parse_tei(name)
    why = unavailable_reason(home)
    if why:
        raise TeiUnavailable(why)
    src = Path(rerank_model or model_dir)
    model = ort_folder(src, onnx_for(src, spec.quantize, spec.fused)) if spec.backend == "ort" else src
    port, prom = two_ports()
    argv = tei_argv(runner_path(home), model, port, prom, spec.flags)
    srv = TeiServer(name, argv, port, health="/health", log_dir=log_dir, prometheus_port=prom,
                    startup_timeout_s=120)
    t = api_target(name, srv, rerank=rerank_model is not None)
    t.notes.append(f"TEI {TEI_VERSION} {spec.backend}" + (" int8" if spec.quantize else "")
                   + (" fused graph" if spec.fused else ""))
    return t




def na_reason(name: str, scenario: str) -> str:
    """The n/a note of a TEI target left out of a scenario."""
    if scenario == "4-rerank" and parse_tei(name).quantize:
        return ("no embedops int8 reranker to set it against (embedops' int8 quality gate refused this "
                "model), so no like-for-like int8 graph for TEI")
    return "not run"


# ---------------------------------------------------------------- build

def _mirror(root: str | None, repo: str) -> str | None:
    if not root:
        return None
    p = Path(root) / repo.replace("/", "+") / "repo"
    return str(p) if p.is_dir() else None


def build(tei_git: str | None = None, candle_git: str | None = None, insta_git: str | None = None,
          *, home: Path | None = None, log=print) -> Path:
    """Run the kit's build.sh (idempotent: a re-run takes seconds) at ``nice -n 19``; returns run-tei."""
    kit = kit_dir() / "build.sh"
    if not kit.is_file():
        raise TeiUnavailable(f"no TEI build kit at {kit} (set EMBEDOPS_TEI_KIT)")
    root = os.environ.get("EMBEDOPS_TEI_MIRROR")  # <root>/<owner>+<name>/repo, as the kit's README says
    srcs = {"--tei-git": tei_git or os.environ.get("EMBEDOPS_TEI_GIT")
            or _mirror(root, "huggingface/text-embeddings-inference"),
            "--candle-git": candle_git or os.environ.get("EMBEDOPS_CANDLE_GIT") or _mirror(root, "huggingface/candle"),
            "--insta-git": insta_git or os.environ.get("EMBEDOPS_INSTA_GIT") or _mirror(root, "OlivierDehaene/insta")}
    missing = [k for k, v in srcs.items() if not v]
    if missing:
        raise TeiUnavailable(f"TEI sources not given: {' '.join(missing)} (git dirs or clones of "
                             "huggingface/text-embeddings-inference, huggingface/candle, OlivierDehaene/insta; "
                             "or EMBEDOPS_TEI_MIRROR=<root with owner+name/repo>)")
    home = home or tei_home()
    argv = ["nice", "-n", "19", str(kit), *[x for kv in srcs.items() for x in kv], "--out", str(home)]
    log("building TEI:", " ".join(argv))
    subprocess.run(argv, check=True)
    if unavailable_reason(home):
        raise TeiUnavailable(f"the kit ran but {runner_path(home)} is missing")
    return runner_path(home)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tei", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build TEI with the kit (cached; ~12+ min the first time)")
    b.add_argument("--tei-git")
    b.add_argument("--candle-git")
    b.add_argument("--insta-git")
    sub.add_parser("status", help="say whether the TEI build is there")
    args = ap.parse_args(argv)
    if args.cmd == "status":
        why = unavailable_reason()
        print(why or f"TEI {TEI_VERSION}: {runner_path()}")
        return 1 if why else 0
    try:
        print(build(args.tei_git, args.candle_git, args.insta_git))
    except (TeiUnavailable, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
