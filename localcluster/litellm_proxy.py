"""A real LiteLLM proxy (issue 19), in a virtual environment of its own: what the operator's LiteLLM entries
are written for.

LiteLLM 1.110.2 is the one version this machine's PyPI serves, and its ``[proxy]`` extra cannot be installed
here: it pins ``litellm-proxy==1.110.2`` (a wheel of metadata only, not served) and
``litellm-proxy-extras==0.4.114.post1`` (not served either; 0.4.110 is). The proxy's code ships in the
``litellm`` wheel itself, so the environment is ``litellm`` plus the extra's runtime requirements, named
here with the bounds the extra gives, and the three imports the proxy's modules need that the extra leaves to
``litellm-proxy`` (``semver``, ``expression``, ``soundfile``; found by importing ``litellm.proxy.proxy_server``).
Its own environment: its pins (fastapi >= 0.136.3, starlette >= 1.0.1, ...) are not the project's.

API::

    bin = litellm_proxy.install()       # idempotent; ~/.cache/embedops/litellm-<version>-<hash>/bin
    with litellm_proxy.run(config, env) as url:   # the proxy on a free loopback port, ready
        ...
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .components import cache_dir

LITELLM_VERSION = "1.110.2"
REQUIREMENTS = (
    f"litellm=={LITELLM_VERSION}",
    # litellm[proxy]'s runtime requirements, less litellm-proxy / -extras / -enterprise (see above)
    "uvicorn>=0.33.0,<1.0", "uvloop>=0.22.1,<1.0", "gunicorn>=23.0.0,<24.0", "fastapi>=0.136.3,<1.0",
    "starlette>=1.0.1,<2.0", "backoff>=2.2.1,<3.0", "pyyaml>=6.0.3,<7.0", "rq>=2.7.0,<3.0",
    "orjson>=3.11.6,<4.0", "apscheduler>=3.11.2,<4.0", "fastapi-sso>=0.19.0,<1.0", "pyjwt>=2.13.0,<3.0",
    "python-multipart>=0.0.27,<1.0", "cryptography>=49.0.0,<51.0", "pynacl>=1.6.2,<2.0",
    "websockets>=15.0.1,<16.0", "mcp>=2.3.0,<3", "litellm-proxy-extras==0.4.110",
    # imported by litellm.proxy's modules, declared by the litellm-proxy wheel this machine cannot get
    "semver", "expression", "soundfile",
)
MASTER_KEY = "sk-embedops-local-0123456789abcdef"  # LiteLLM refuses to start with no or a weak master key


def _log(msg: str) -> None:
    print(f"[litellm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env_dir() -> Path:
    key = hashlib.sha256("\n".join((sys.version.split()[0], *REQUIREMENTS)).encode()).hexdigest()[:8]
    return cache_dir() / f"litellm-{LITELLM_VERSION}-{key}"


def install() -> Path:
    """The environment's bin folder, made once (a venv is not relocatable: built in place, marked complete
    last, rebuilt when a previous build stopped halfway)."""
    d = env_dir()
    if (d / ".complete").exists():
        return d / "bin"
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f".{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / ".complete").exists():
            return d / "bin"
        shutil.rmtree(d, ignore_errors=True)
        t = time.monotonic()
        log = d.parent / "logs" / f"{d.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        _log(f"installing LiteLLM {LITELLM_VERSION} into {d} (log {log})")
        with open(log, "w") as f:
            for argv in ([sys.executable, "-m", "venv", str(d)],
                         [str(d / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                          *REQUIREMENTS]):
                r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT)
                if r.returncode != 0:
                    raise RuntimeError(f"`{' '.join(argv[:4])} ...` exited {r.returncode}; log {log}:\n"
                                       + log.read_text()[-3000:])
        (d / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        _log(f"LiteLLM {LITELLM_VERSION} installed in {time.monotonic() - t:.0f}s")
    return d / "bin"


IMAGE_PYTHON = "3.11.2"  # Debian bookworm's python3, the base image's
IMAGE_ONLY = ("async-timeout>=4.0.3",)  # redis requires it on python_full_version < "3.11.3"
IMAGE_CONTAINERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN --mount=type=bind,target=/ctx python3 -m venv /opt/litellm \\
    && /opt/litellm/bin/pip install --no-index --find-links /ctx/wheels --disable-pip-version-check \\
       --no-compile -r /ctx/requirements.txt
ENV PATH=/opt/litellm/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 65534
ENTRYPOINT ["litellm"]
"""


def wheelhouse() -> Path:
    """cp311 x86_64 wheels of REQUIREMENTS (and what they need), for the image; made once."""
    if sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"the LiteLLM wheelhouse must be made by a Python 3.11 (the images' python3), not {sys.version}")
    key = hashlib.sha256("\n".join((IMAGE_PYTHON, *REQUIREMENTS, *IMAGE_ONLY)).encode()).hexdigest()[:8]
    out = cache_dir() / "images" / f"wheels-litellm-{LITELLM_VERSION}-{key}"
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t = time.monotonic()
    # for the base image's python3 (Debian's 3.11.2): pip's --python-version does not reach markers on
    # python_full_version, so what those add below 3.11.3 is named (IMAGE_ONLY)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
                        f"--python-version={IMAGE_PYTHON}", "--dest", str(tmp), *REQUIREMENTS, *IMAGE_ONLY],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download of LiteLLM's wheels failed:\n{r.stdout[-3000:]}")
    (tmp / "requirements.txt").write_text("\n".join(REQUIREMENTS) + "\n")
    (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _log(f"LiteLLM wheelhouse: {len(list(out.glob('*.whl')))} wheels in {time.monotonic() - t:.0f}s")
    return out


def image():
    """``localhost/embedops-litellm:<hash>``: LiteLLM's proxy in a venv on the Debian base, entry point
    ``litellm``, user nobody; ``<hash>`` covers the wheels, the Containerfile and the base."""
    from . import images

    why = images.podman_usable()
    if why:
        raise RuntimeError(why)
    wheels = wheelhouse()
    base = images.base_image()
    h = hashlib.sha256(f"{images.local_image_id(base) or base}\0{IMAGE_CONTAINERFILE}".encode())
    for w in sorted(wheels.glob("*.whl")):
        h.update(f"{w.name}\0".encode())
    tag = h.hexdigest()[:12]
    ref = f"localhost/embedops-litellm:{tag}"
    archives = images.cache_root() / "archives"
    archives.mkdir(parents=True, exist_ok=True)

    def context(ctx: Path) -> None:
        images.link_wheels(wheels, ctx / "wheels")
        shutil.copy2(wheels / "requirements.txt", ctx / "requirements.txt")
        (ctx / "Containerfile").write_text(IMAGE_CONTAINERFILE)

    with images.build_lock(ref):
        img = images.build_locked("litellm", ref, "Containerfile", {"BASE_IMAGE": base},
                                   archives / f"litellm-{tag}.tar", None, make_context=context)
    images.prune_builds("litellm", keep=archives / f"litellm-{tag}.tar", repo="localhost/embedops-litellm", suffix="")
    return img


@contextlib.contextmanager
def run(config: Path, env: dict[str, str] | None = None, timeout: float = 180):
    """``litellm --config <config>`` on a free loopback port until the block ends; yields its URL once
    ``/health/liveliness`` answers. The process gets ``env`` on top of a minimal environment (PATH, HOME)
    and LITELLM_MASTER_KEY, so nothing of the caller's environment (an API key variable) leaks in."""
    from .pki import free_port

    bin_dir = install()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = config.parent / "litellm.log"
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(config.parent), "LITELLM_MASTER_KEY": MASTER_KEY,
            "LITELLM_LOG": "INFO", "PYTHONUNBUFFERED": "1"}
    t = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(bin_dir / "litellm"), "--config", str(config), "--host", "127.0.0.1",
                                 "--port", str(port)], env={**base, **(env or {})}, stdout=f,
                                stderr=subprocess.STDOUT, cwd=config.parent)
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health/liveliness", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() - t > timeout:
                raise RuntimeError(f"LiteLLM proxy {'exited ' + str(proc.returncode) if proc.poll() is not None else 'not ready'}"
                                   f" after {time.monotonic() - t:.0f}s; log {log}:\n"
                                   + log.read_text(errors="replace")[-4000:])
            time.sleep(0.5)
        _log(f"LiteLLM proxy ready at {url} in {time.monotonic() - t:.0f}s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log_of(config: Path) -> str:
    p = config.parent / "litellm.log"
    return p.read_text(errors="replace") if p.exists() else ""

