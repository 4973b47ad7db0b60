"""Build embedops' container images locally with podman, cached, and hand them to containerd.

No container registry can be reached here, so everything is made from package registries:

* the base image ``localhost/embedops-base:bookworm-py3.11`` (stands in for ``python:3.11-slim``):
  ``debootstrap --variant=minbase bookworm`` with python3, python3-venv and libgomp1, imported with
  ``podman import``; made once (skipped while podman has it); its image id goes into every tag below, so
  images built on a new base get new tags;
* a wheelhouse ``$EMBEDOPS_CACHE/images/wheels-<hash>`` (``~/.cache/embedops`` by default): every wheel of
  the ``server`` and ``operator`` extras of pyproject.toml plus the build backend, made with ``pip wheel`` on
  the host (pip inside a build container cannot reach PyPI); reused while pyproject.toml is unchanged;
* the images, built with ``podman build --network=none`` from a small context (pyproject.toml, a stand-in README.md,
  server/, operator/, the wheels) with ``WHEELS=wheels`` (pip installs offline) and ``TORCH_SPEC=`` (no torch:
  PyPI's torch is the CUDA build and PyTorch's CPU index cannot be reached; the CPU image is ONNX Runtime
  only and serves model folders that ship an ONNX file):

    ``localhost/embedops-server:<tag>-cpu``   server/Dockerfile.cpu
    ``localhost/embedops-operator:<tag>``     operator/Dockerfile
    ``localhost/embedops-server:<tag>-cuda``  server/Dockerfile.cuda with PyPI's torch + nvidia-* wheels;
                                              only with ``cuda=True`` / ``--cuda`` (several GB)

  ``<tag>`` is a content hash of the Dockerfile, the build arguments, the sources, the wheel names and sizes
  and the base image id: an unchanged tree finds its images and builds nothing;
* one archive per image, ``$EMBEDOPS_CACHE/images/archives/<name>-<tag>.tar`` (``podman save --format
  docker-archive``; the image ref inside is the tag above), which ``ctr images import`` of containerd 1.6
  accepts.

API (importable by tests/e2e and localcluster/node.py; all calls are safe from several processes at once,
they serialize on a lock file in the cache)::

    build(names=("server", "operator"), cuda=False) -> dict[str, Image]
        names: "server", "operator", "server-cuda" (cuda=True adds "server-cuda").
    Image(name, ref, archive: Path, size_bytes: int, archive_bytes: int, image_id: str, built: bool)
        size_bytes: the image as podman reports it (uncompressed); built: False when it was cached.
    import_into_containerd(address, images, namespace="k8s.io") -> list[str]
        images: build()'s dict or an iterable of Image. Runs ``ctr --address <address> -n <namespace> images
        import <archive>`` for each image the containerd does not already hold under the same ref and digest;
        returns the refs it imported.
    base_image() -> str; wheelhouse() -> Path; podman_usable() -> str | None (why not, None when it works)

CLI: ``python -m localcluster.images build [server] [operator] [--cuda]`` prints a JSON summary.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
BASE_REF = "localhost/embedops-base:bookworm-py3.11"
BASE_PACKAGES = ("python3", "python3-venv", "libgomp1")
DEFAULT_MIRROR = "http://deb.debian.org/debian"

# name -> (Dockerfile, repository, tag suffix, build arguments besides BASE_IMAGE and WHEELS)
IMAGES: dict[str, tuple[str, str, str, dict[str, str]]] = {
    "server": ("server/Dockerfile.cpu", "localhost/embedops-server", "-cpu", {"TORCH_SPEC": ""}),
    "operator": ("operator/Dockerfile", "localhost/embedops-operator", "", {}),
    "server-cuda": ("server/Dockerfile.cuda", "localhost/embedops-server", "-cuda", {}),
}
CONTEXT_DIRS = ("server", "operator")
CONTEXT_FILES = ("pyproject.toml",)
# pyproject.toml names README.md as the package's long description; the image only needs the file to exist,
# and a README edit must not rebuild the images (2 min each), so the context gets this stand-in.
README_STANDIN = "# embedops\n\nBuilt locally by localcluster/images.py; see the repository's README.md.\n"


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    archive: Path
    size_bytes: int
    archive_bytes: int
    image_id: str
    built: bool = False


def cache_root() -> Path:
    return Path(os.environ.get("EMBEDOPS_CACHE") or Path.home() / ".cache" / "embedops") / "images"


def say(msg: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_command(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    kw.setdefault("text", True)
    return subprocess.run(cmd, **kw)


@contextlib.contextmanager
def build_lock(what: str):
    """One builder at a time per thing (the base, a wheelhouse, an image tag), across processes: a long CUDA
    build does not hold up the CPU images."""
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / what.replace("/", "_").replace(":", "_"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def podman_usable() -> str | None:
    """None when podman can build and run containers here, else why not (for a test's skip reason)."""
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/host-packages.sh installs it)"
    r = subprocess.run(["podman", "info", "--format", "{{.Store.GraphDriverName}}"], capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        return f"podman cannot run here: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
    return None


def local_image_id(ref: str) -> str | None:
    r = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def local_image_size(ref: str) -> int:
    return int(run_command(["podman", "image", "inspect", "--format", "{{.Size}}", ref], capture_output=True).stdout)


# ---------------------------------------------------------------------------------------------- base image


def debian_mirror() -> str:
    """The first Debian URI of the host's deb822 sources (the same mirror apt uses here)."""
    src = Path("/etc/apt/sources.list.d/debian.sources")
    try:
        for line in src.read_text().splitlines():
            if line.startswith("URIs:"):
                uri = line.split(":", 1)[1].split()[0]
                if not uri.rstrip("/").endswith("-security"):
                    return uri
    except OSError:
        pass
    return DEFAULT_MIRROR


def base_image() -> str:
    """``localhost/embedops-base:bookworm-py3.11``, made with debootstrap when podman does not have it."""
    with build_lock("base"):
        if not local_image_id(BASE_REF):
            _make_base()
    return BASE_REF


def _make_base() -> None:
    debootstrap_image(BASE_REF, BASE_PACKAGES, changes=('CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"))


def debootstrap_image(ref: str, packages: Iterable[str], changes: Iterable[str] = ()) -> None:
    """``ref`` made from ``debootstrap --variant=minbase bookworm`` with ``packages``, trimmed (``trim_rootfs``),
    and ``podman import``ed with the Containerfile ``changes`` (CMD, ENV, ...)."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (scripts/host-packages.sh installs it)")
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="base-", dir=cache_root()))
    try:
        rootfs = work / "rootfs"
        mirror = debian_mirror()
        say(f"debootstrap --variant=minbase bookworm from {mirror} for {ref} (a few minutes)")
        run_command(["debootstrap", "--variant=minbase", "--include=" + ",".join(packages), "bookworm",
              str(rootfs), mirror], stdout=subprocess.DEVNULL)
        trim_rootfs(rootfs)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        run_command(["podman", "import", *(a for c in changes for a in ("--change", c)), "--quiet", "-", ref],
                    stdin=tar.stdout, capture_output=True)
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrap root failed")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{ref} imported in {time.time() - t0:.0f}s ({local_image_size(ref) / 1e6:.0f} MB)")


def trim_rootfs(rootfs: Path) -> None:
    """What an image does not need: downloaded .debs, apt lists, docs, man pages, locales but C."""
    for d in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
              "usr/share/info", "var/log"):
        p = rootfs / d
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                elif child.name != "lock":
                    child.unlink(missing_ok=True)
    locales = rootfs / "usr/share/locale"
    if locales.is_dir():
        for child in locales.iterdir():
            if child.is_dir() and child.name not in ("C.UTF-8", "C.utf8"):
                shutil.rmtree(child, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- wheelhouse


def _requirements(extras: Iterable[str]) -> tuple[list[str], list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(data["project"].get("dependencies", []))
    for extra in extras:
        reqs += data["project"]["optional-dependencies"][extra]
    return reqs, list(data["build-system"]["requires"])


def _pip(*args: str) -> None:
    run_command([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], stdout=subprocess.DEVNULL)


def wheelhouse(cuda: bool = False) -> Path:
    """Wheels of the server and operator extras (plus the build backend) for cp311 x86_64, reused while
    pyproject.toml is unchanged; ``cuda=True``: torch (PyPI's CUDA build) and its nvidia-* wheels on top."""
    if sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"the wheelhouse must be made by a Python 3.11 (the images' python3), not {sys.version}")
    reqs, build_reqs = _requirements(("server", "operator"))
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    key.update(f"{sys.version_info[:2]} {platform.machine()} {sorted(reqs)} {build_reqs}".encode())
    torch_req = None
    if cuda:
        torch_req = _torch_spec()
        key.update(torch_req.encode())
    name = ("wheels-cuda-" if cuda else "wheels-") + key.hexdigest()[:12]
    out = cache_root() / name
    with build_lock(name):
        if not (out / ".complete").exists():
            _make_wheelhouse(out, reqs, build_reqs, torch_req)
    return out


def _make_wheelhouse(out: Path, reqs: list[str], build_reqs: list[str], torch_req: str | None) -> None:
    name, root = out.name, out.parent
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=name + ".tmp-", dir=root))
    try:
        say(f"wheelhouse {out.name}: pip wheel for {len(reqs)} requirements")
        _pip("wheel", "--wheel-dir", str(tmp), *reqs, *([torch_req] if torch_req else []))
        # the build backend, for pip's isolated build of the project inside the image
        _pip("download", "--only-binary=:all:", "--dest", str(tmp), *build_reqs)
        (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len(list(out.glob("*.whl")))
    say(f"wheelhouse {out.name}: {n} wheels, {_du(out) / 1e6:.0f} MB in {time.time() - t0:.0f}s")


def _torch_spec() -> str:
    """The torch the project's venv runs (what pip's cache holds after setup.sh), else the Dockerfile default."""
    try:
        from importlib.metadata import version

        return f"torch=={version('torch').split('+')[0]}"  # PyPI's 2.15.0 is a CUDA build (2.15.0+cu132)
    except Exception:
        return "torch==2.15.0"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------------- images


def _context_files() -> list[tuple[str, Path]]:
    files = [(name, ROOT / name) for name in CONTEXT_FILES]
    for d in CONTEXT_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            rel = p.relative_to(ROOT)
            if p.is_file() and "__pycache__" not in rel.parts and p.suffix != ".pyc" \
                    and not any(part.endswith(".egg-info") for part in rel.parts):
                files.append((str(rel), p))
    return files


def _tag(name: str, wheels: Path, base_id: str, build_args: dict[str, str]) -> str:
    dockerfile = IMAGES[name][0]
    h = hashlib.sha256(f"{name}\0{dockerfile}\0{sorted(build_args.items())}\0{base_id}\0{README_STANDIN}".encode())
    for rel, path in _context_files():
        h.update(f"{rel}\0".encode() + hashlib.sha256(path.read_bytes()).digest())
    hash_wheels(h, wheels)
    return h.hexdigest()[:12]


def hash_wheels(h, wheels: Path) -> None:
    """The wheelhouse in a build's tag: each wheel's name and size (its version and build are in its name)."""
    for w in sorted(wheels.glob("*.whl")):
        h.update(f"{w.name}\0{w.stat().st_size}\0".encode())


def _make_context(ctx: Path, wheels: Path) -> None:
    for rel, path in _context_files():
        dest = ctx / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    (ctx / "README.md").write_text(README_STANDIN)
    link_wheels(wheels, ctx / "wheels")


def link_wheels(wheels: Path, dest: Path) -> None:
    """The wheelhouse's wheels into a build context's folder ``dest``: hard links (the same file system, both in
    the cache: no copy), copies where a link is refused."""
    dest.mkdir()
    for w in wheels.glob("*.whl"):
        try:
            os.link(w, dest / w.name)
        except OSError:
            shutil.copy2(w, dest / w.name)


# The dependencies of an image in a venv of their own image, so that a source change (every commit) installs only
# the project over them: the server image in 23 s instead of 83 (pip installed 81 wheels again; docs/images.md).
# The project's metadata is installed without its code to resolve them as the Dockerfile's own
# `pip install ".[extra]"` does, then removed.
DEPS_CONTAINERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG EXTRA
ARG TORCH_SPEC=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_FIND_LINKS=/ctx/wheels
WORKDIR /src
COPY pyproject.toml README.md ./
RUN --mount=type=bind,target=/ctx python3 -m venv /opt/venv \\
    && mkdir server operator \\
    && if [ -n "$TORCH_SPEC" ]; then /opt/venv/bin/pip install "$TORCH_SPEC"; fi \\
    && /opt/venv/bin/pip install ".[$EXTRA]" && /opt/venv/bin/pip uninstall --yes embedops \\
    && rm -rf /src/*
"""
DEPS_REPO = "localhost/embedops-deps"


def deps_image(name: str, wheels: Path, base: str, torch_spec: str) -> str:
    """``localhost/embedops-deps:<tag>-<name>``: the base with /opt/venv holding the image's dependencies from the
    wheelhouse; ``<tag>`` hashes pyproject.toml, the wheels, the base and this recipe. Made when missing."""
    extra = "operator" if name == "operator" else "server"
    h = hashlib.sha256(f"{DEPS_CONTAINERFILE}\0{extra}\0{torch_spec}\0{local_image_id(base) or base}\0"
                       f"{README_STANDIN}".encode())
    h.update((ROOT / "pyproject.toml").read_bytes())
    hash_wheels(h, wheels)
    ref = f"{DEPS_REPO}:{h.hexdigest()[:12]}-{name}"

    def context(ctx: Path) -> None:
        shutil.copy2(ROOT / "pyproject.toml", ctx / "pyproject.toml")
        (ctx / "README.md").write_text(README_STANDIN)
        (ctx / "Containerfile").write_text(DEPS_CONTAINERFILE)
        link_wheels(wheels, ctx / "wheels")
    with build_lock(ref):
        if not local_image_id(ref):
            podman_build(f"deps-{name}", ref, "Containerfile",
                         {"BASE_IMAGE": base, "EXTRA": extra, "TORCH_SPEC": torch_spec}, context,
                         cache_root() / "archives" / f"deps-{name}.build.log")
            _prune_deps(name, keep=ref)
    return ref


def _prune_deps(name: str, keep: str) -> None:
    """The KEEP newest dependency images of ``name``: older pyproject.toml versions' are removed."""
    r = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}} {{.CreatedAt}}", DEPS_REPO],
                       capture_output=True, text=True)
    refs = [line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0].endswith(f"-{name}")]
    refs.sort(key=lambda x: x[1] if len(x) > 1 else "", reverse=True)
    for ref in [x[0] for x in refs if x[0] != keep][KEEP - 1:]:
        subprocess.run(["podman", "rmi", ref], capture_output=True)  # fails while in use: fine


def _build_one(name: str, wheels: Path, base: str) -> Image:
    dockerfile, repo, suffix, extra_args = IMAGES[name]
    base_id = local_image_id(base) or base
    args = {"BASE_IMAGE": base, "WHEELS": "wheels", **extra_args}
    if name == "server-cuda":
        args["TORCH_SPEC"] = _torch_spec()  # the one in the CUDA wheelhouse
    args["BUILD_IMAGE"] = deps_image(name, wheels, base, args.get("TORCH_SPEC", ""))
    tag = _tag(name, wheels, base_id, args) + suffix
    ref = f"{repo}:{tag}"
    archives = cache_root() / "archives"
    archives.mkdir(parents=True, exist_ok=True)
    archive = archives / f"{name}-{tag}.tar"
    with build_lock(ref):
        img = build_locked(name, ref, dockerfile, args, archive, wheels)
    prune_builds(name, keep=archive)
    return img


def podman_build(name: str, ref: str, dockerfile: str, args: dict[str, str], make_context: Callable[[Path], None],
                 log: Path) -> None:
    """``podman build`` of ``ref`` from a context ``make_context(folder)`` fills, its output in ``log``."""
    t0 = time.time()
    ctx = Path(tempfile.mkdtemp(prefix=f"ctx-{name}-", dir=cache_root()))
    try:
        make_context(ctx)
        # no layer cache: a new tag means new sources, and cached stages would pile up as <none> images
        cmd = ["podman", "build", "--network=none", "--pull=never", "--layers=false", "--rm",
               "-f", str(ctx / dockerfile), "-t", ref]
        for k, v in args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        log.parent.mkdir(parents=True, exist_ok=True)
        say(f"building {ref} (log {log})")
        with open(log, "w") as f:
            r = subprocess.run([*cmd, str(ctx)], stdout=f, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            tail = log.read_text()[-6000:]
            raise RuntimeError(f"podman build of {ref} failed (rc {r.returncode}), log {log}:\n{tail}")
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    say(f"built {ref} in {time.time() - t0:.0f}s")


def build_locked(name: str, ref: str, dockerfile: str, args: dict[str, str], archive: Path,
                  wheels: Path | None, make_context=None) -> Image:
    built = False
    if not local_image_id(ref):
        if make_context is None:
            assert wheels is not None
            make_context = lambda ctx: _make_context(ctx, wheels)  # noqa: E731
        podman_build(name, ref, dockerfile, args, make_context, archive.with_suffix(".build.log"))
        built = True
    image_id = local_image_id(ref) or ""
    stamp = archive.with_suffix(".id")
    if not archive.exists() or not stamp.exists() or stamp.read_text() != image_id:
        t0 = time.time()
        tmp = archive.with_suffix(".tar.tmp")
        tmp.unlink(missing_ok=True)
        run_command(["podman", "save", "--quiet", "--format", "docker-archive", "-o", str(tmp), ref], capture_output=True)
        os.replace(tmp, archive)
        stamp.write_text(image_id)
        say(f"saved {archive} in {time.time() - t0:.0f}s")
    return Image(name, ref, archive, local_image_size(ref), archive.stat().st_size, image_id, built)


BINARY_CONTAINERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY bin/ /bin/
USER 65534
ENTRYPOINT ["/bin/%s"]
"""


def build_binary_image(name: str, binaries: Iterable[Path]) -> Image:
    """An image of upstream static binaries (Prometheus, its config reloader, ...) on the Debian base, as
    ``localhost/embedops-<name>:<tag>``: each binary in /bin, the first one the entry point, user nobody (the
    controllers that run these images set their own user). ``<tag>`` hashes the binaries and the base."""
    binaries = [Path(b) for b in binaries]
    why = podman_usable()
    if why:
        raise RuntimeError(why)
    base = base_image()
    h = hashlib.sha256(f"{name}\0{local_image_id(base) or base}\0{BINARY_CONTAINERFILE}".encode())
    for b in binaries:
        with open(b, "rb") as f:
            h.update(f"{b.name}\0".encode() + hashlib.file_digest(f, "sha256").digest())
    tag = h.hexdigest()[:12]
    ref = f"localhost/embedops-{name}:{tag}"
    archives = cache_root() / "archives"
    archives.mkdir(parents=True, exist_ok=True)
    archive = archives / f"{name}-{tag}.tar"

    def context(ctx: Path) -> None:
        (ctx / "bin").mkdir()
        for b in binaries:
            try:
                os.link(b, ctx / "bin" / b.name)
            except OSError:
                shutil.copy2(b, ctx / "bin" / b.name)
        (ctx / "Containerfile").write_text(BINARY_CONTAINERFILE % binaries[0].name)

    with build_lock(ref):
        img = build_locked(name, ref, "Containerfile", {"BASE_IMAGE": base}, archive, None, make_context=context)
    prune_builds(name, keep=archive, repo=f"localhost/embedops-{name}", suffix="")
    return img


KEEP = 3  # tags kept per image name (archives and podman images); older ones are removed


def prune_builds(name: str, keep: Path, repo: str | None = None, suffix: str | None = None) -> None:
    if repo is None or suffix is None:
        repo, suffix = IMAGES[name][1], IMAGES[name][2]
    mine = re.compile(rf"{re.escape(name)}-([0-9a-f]{{12}}{re.escape(suffix)})\.tar")
    archives = sorted((a for a in (cache_root() / "archives").glob("*.tar") if mine.fullmatch(a.name)),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for a in [a for a in archives if a != keep][KEEP - 1:]:
        tag = mine.fullmatch(a.name).group(1)
        subprocess.run(["podman", "rmi", f"{repo}:{tag}"], capture_output=True)  # fails while in use: fine
        for f in a.parent.glob(f"{name}-{tag}.*"):
            f.unlink(missing_ok=True)


def build(names: Iterable[str] = ("server", "operator"), cuda: bool = False) -> dict[str, Image]:
    """Build (or find) the named images and their archives; see the module docstring."""
    names = list(dict.fromkeys([*names, *(["server-cuda"] if cuda else [])]))
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        raise ValueError(f"unknown image(s) {unknown}; known: {sorted(IMAGES)}")
    why = podman_usable()
    if why:
        raise RuntimeError(why)
    out: dict[str, Image] = {}
    base = base_image()
    cpu_names = [n for n in names if n != "server-cuda"]
    if cpu_names:
        wheels = wheelhouse()
        for n in cpu_names:
            out[n] = _build_one(n, wheels, base)
    if "server-cuda" in names:
        out["server-cuda"] = _build_one("server-cuda", wheelhouse(cuda=True), base)
    return out


# ---------------------------------------------------------------------------------------------- containerd


def _containerd_images(ctr: list[str]) -> dict[str, str]:
    r = run_command([*ctr, "images", "ls"], capture_output=True)
    found = {}
    for line in r.stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 3:
            found[cols[0]] = cols[2]
    return found


def import_into_containerd(address: str, images, namespace: str = "k8s.io") -> list[str]:
    """Import each image's archive into the containerd at ``address`` (its socket) unless it already holds the
    same ref with the digest a previous import of that archive produced. Returns the refs imported."""
    if isinstance(images, dict):
        images = images.values()
    ctr = ["ctr", "--address", address, "-n", namespace]
    present = _containerd_images(ctr)
    imported = []
    for img in images:
        digest_file = Path(img.archive).with_suffix(".ctr-digest")
        want = digest_file.read_text().strip() if digest_file.exists() else None
        if want and present.get(img.ref) == want:
            continue
        run_command([*ctr, "images", "import", str(img.archive)], capture_output=True)
        got = _containerd_images(ctr).get(img.ref)
        if got is None:
            raise RuntimeError(f"ctr imported {img.archive} but containerd at {address} has no {img.ref}")
        digest_file.write_text(got)
        imported.append(img.ref)
    return imported


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m localcluster.images", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or find) the images and their containerd archives")
    b.add_argument("names", nargs="*", metavar="NAME", help="server, operator, server-cuda (default: server operator)")
    b.add_argument("--cuda", action="store_true", help="also the CUDA server image (several GB; not in CI)")
    a = p.parse_args(argv)
    t0 = time.time()
    images = build(a.names or ["server", "operator"], cuda=a.cuda)
    summary = {n: {**asdict(img), "archive": str(img.archive)} for n, img in images.items()}
    print(json.dumps({"images": summary, "seconds": round(time.time() - t0, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
