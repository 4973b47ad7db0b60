"""A PostgreSQL + pgvector image for the query-time pattern (examples/query-time), made from Debian packages.

No container registry can be reached here, so ``pgvector/pgvector:pg17`` cannot be pulled. Debian bookworm has
no pgvector package; trixie has ``postgresql-17-pgvector`` on the same mirror, so the image is
``debootstrap --variant=minbase trixie`` with PostgreSQL 17, pgvector and python3-psycopg2 (the ingestion Job
and the query client of the example run in it too), imported with ``podman import``.

The image is shaped like the upstream one where the example depends on it: the binaries in
``/usr/lib/postgresql/17/bin`` (on PATH), user ``postgres`` with uid/gid 999 (the official postgres images'
ids, so the example's ``runAsUser: 999`` works on both), no cluster created (the example's start script runs
``initdb`` into its volume). Cached like the other images: the tag hashes the suite, the packages and this
recipe; a second call finds it.

    image() -> localcluster.images.Image    # localhost/embedops-pgvector:<tag> and its archive
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from . import images

SUITE = "trixie"
PACKAGES = ("postgresql-17", "postgresql-17-pgvector", "python3-psycopg2")
PG_BIN = "/usr/lib/postgresql/17/bin"
UID = GID = 999
NAME = "pgvector"
REPO = f"localhost/embedops-{NAME}"
RECIPE = 2  # bump when the steps below change what the image holds


def _tag() -> str:
    h = hashlib.sha256(f"{SUITE}\0{','.join(PACKAGES)}\0{PG_BIN}\0{UID}\0{RECIPE}".encode())
    return h.hexdigest()[:12]


def image() -> images.Image:
    """``localhost/embedops-pgvector:<tag>`` (made when podman does not have it) and its containerd archive."""
    why = images.podman_usable()
    if why:
        raise RuntimeError(why)
    tag = _tag()
    ref = f"{REPO}:{tag}"
    archives = images.cache_root() / "archives"
    archives.mkdir(parents=True, exist_ok=True)
    archive = archives / f"{NAME}-{tag}.tar"
    with images.build_lock(ref):
        if not images.local_image_id(ref):
            _make(ref)
        # finds the image and only writes (or reuses) its archive
        img = images.build_locked(NAME, ref, "", {}, archive, None)
    images.prune_builds(NAME, keep=archive, repo=REPO, suffix="")
    return img


def _renumber_postgres(rootfs: Path) -> None:
    """Debian gives the postgres user the next free system ids (100/102 here); the official images use 999.
    Rewrite passwd and group and hand postgres' own folders to the new ids."""
    old: dict[str, tuple[int, int]] = {}
    for name, field in (("passwd", 2), ("group", 2)):
        path = rootfs / "etc" / name
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            parts = line.split(":")
            if parts[0] == "postgres":
                old[name] = (int(parts[field]), int(parts[3]) if name == "passwd" else -1)
                parts[field] = str(UID if name == "passwd" else GID)
                if name == "passwd":
                    parts[3] = str(GID)
                lines[i] = ":".join(parts)
        path.write_text("\n".join(lines) + "\n")
    old_uid, old_gid = old["passwd"][0], old["group"][0]
    for d in ("var/lib/postgresql", "var/run/postgresql", "run/postgresql", "var/log/postgresql",
              "etc/postgresql"):
        top = rootfs / d
        if not top.exists() or top.is_symlink():
            continue
        for p in [top, *top.rglob("*")]:
            st = p.lstat()
            uid = UID if st.st_uid == old_uid else st.st_uid
            gid = GID if st.st_gid == old_gid else st.st_gid
            if (uid, gid) != (st.st_uid, st.st_gid):
                os.lchown(p, uid, gid)


def _make(ref: str) -> None:
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (scripts/host-packages.sh installs it)")
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="pgvector-", dir=images.cache_root()))
    try:
        rootfs = work / "rootfs"
        mirror = images.debian_mirror()
        images.say(f"debootstrap --variant=minbase {SUITE} with {' '.join(PACKAGES)} from {mirror} (about a minute)")
        images.run_command(["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), SUITE, str(rootfs),
                     mirror], stdout=subprocess.DEVNULL)
        # postgresql-common made a default cluster (17/main); the example's initdb makes its own in a volume
        for d in ("var/lib/postgresql/17", "etc/postgresql/17"):
            shutil.rmtree(rootfs / d, ignore_errors=True)
        images.trim_rootfs(rootfs)
        _renumber_postgres(rootfs)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        images.run_command(["podman", "import", "--change", 'CMD ["/bin/bash"]', "--change", "ENV LANG=C.UTF-8",
                     "--change", f"ENV PATH={PG_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     "--change", f"USER {UID}:{GID}", "--quiet", "-", ref], stdin=tar.stdout, capture_output=True)
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrap root failed")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    images.say(f"{ref} imported in {time.time() - t0:.0f}s ({images.local_image_size(ref) / 1e6:.0f} MB)")


if __name__ == "__main__":
    img = image()
    print(img.ref, img.archive, f"{img.size_bytes / 1e6:.0f} MB")
