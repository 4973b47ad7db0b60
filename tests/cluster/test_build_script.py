"""build.sh, the component build behind `make demo` and `make test`: its version checks cannot fail at
random, and a failing step says which one failed.

A fresh machine's first `make demo` once stopped with a bare `Error 141`: `coredns -version | head -1` under
`set -o pipefail`, where `head` exits after one line and CoreDNS, still writing, dies of SIGPIPE. Machines
with the binary cached never run that line, so these tests run the checks themselves, many times over.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "tests" / "cluster"
HELPERS = CLUSTER / "version_check.sh"
SHELL_FILES = [CLUSTER / "build.sh", HELPERS, *sorted((REPO / "scripts").glob("*.sh")),
               REPO / "tests" / "e2e" / "kind.sh", REPO / "Makefile"]
# A reader that may stop before its writer has finished: with pipefail, the writer's SIGPIPE fails the pipeline.
EARLY_READER = re.compile(r"\|\s*(head\b|grep\s+(-\w*q|--quiet)|sed\s+-n\s*['\"]?\d*q|awk\s+['\"][^'\"]*exit)")


def _run_helper(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -Eeuo pipefail; source {HELPERS}; {script}"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def _chatty_binary(tmp_path: Path, first_line: str) -> Path:
    """A binary that prints its version, then much more (CoreDNS prints a second line; 1 MB makes
    SIGPIPE certain for any reader that stops after the first)."""
    exe = tmp_path / "chatty"
    exe.write_text(f"#!/usr/bin/env bash\necho '{first_line}'\nhead -c 1000000 /dev/zero | tr '\\0' x\necho\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_pipeline_has_a_reader_that_stops_early(path):
    code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    bad = [line.strip() for line in code if EARLY_READER.search(line)]
    assert not bad, f"{path.name}: a reader that may exit before its writer under pipefail: {bad}"


def test_version_check_passes_200_times_on_a_binary_that_keeps_writing(tmp_path):
    exe = _chatty_binary(tmp_path, "CoreDNS-1.15.0")
    r = _run_helper(f"for i in $(seq 200); do check_version coredns v1.15.0 {exe} -version; done; echo ok")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_version_check_passes_200_times_on_the_cached_binaries():
    """The real CoreDNS and helm of this machine's cache, when they are there (the demo and CI build them)."""
    env = dict(line.split("=", 1) for line in (CLUSTER / "versions.env").read_text().splitlines()
               if re.match(r"^[A-Z_]+=", line))
    bin_dir = Path(os.environ.get("EMBEDOPS_CACHE", Path.home() / ".cache" / "embedops")) / "bin"
    checks = []
    coredns = bin_dir / f"coredns-{env['COREDNS_VERSION']}" / "coredns"
    if coredns.exists():
        checks.append(f"check_version coredns {env['COREDNS_VERSION']} {coredns} -version")
    helm = bin_dir / f"helm-{env['HELM_VERSION']}" / "helm"
    if helm.exists():
        checks.append(f"check_version helm {env['HELM_VERSION']} {helm} version --template '{{{{.Version}}}}'")
    if not checks:
        pytest.skip(f"neither CoreDNS nor helm is built in {bin_dir} yet")
    r = _run_helper(f"for i in $(seq 200); do {'; '.join(checks)}; done; echo ok")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_version_check_names_the_mismatch(tmp_path):
    exe = _chatty_binary(tmp_path, "CoreDNS-1.14.2")
    r = _run_helper(f"check_version coredns v1.15.0 {exe} -version")
    assert r.returncode != 0
    assert "says 'CoreDNS-1.14.2', versions.env says v1.15.0" in r.stderr


def test_a_failing_step_names_component_command_and_log(tmp_path):
    """A `go` that fails stands for any broken build step: build.sh stops with one line that names the
    component, the command and its log, and the log holds the step's output."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    go = fake_bin / "go"
    go.write_text("#!/bin/sh\necho 'compile: something broke' >&2\nexit 3\n")
    go.chmod(0o755)
    cache = tmp_path / "cache"
    r = subprocess.run(["bash", str(CLUSTER / "build.sh"), "etcd"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "EMBEDOPS_CACHE": str(cache), "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert r.returncode == 3, r.stderr
    log = cache / "logs" / "build-etcd.log"
    failed = [line for line in r.stderr.splitlines() if "FAILED" in line]
    assert len(failed) == 1, r.stderr
    assert "FAILED etcd" in failed[0] and "go build" in failed[0] and "exited 3" in failed[0] and str(log) in failed[0]
    assert "compile: something broke" in log.read_text()
    assert "compile: something broke" in r.stderr  # the log's tail is shown too
