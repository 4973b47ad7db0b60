"""localcluster/build.py, the component build behind `make demo` and `make test`: its version checks cannot fail
at random, a failing step says which one failed, and the component table agrees with the recipes it names.

A fresh machine's first `make demo` once stopped with a bare `Error 141`: `coredns -version | head -1` under
`set -o pipefail` (the shell build of the time), where `head` exits after one line and CoreDNS, still
writing, dies of SIGPIPE. Machines with the binary cached never run that check, so these tests run the checks
themselves, many times over.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localcluster import components
from localcluster.build import COLD_SECONDS, VersionMismatch, check_version

REPO = Path(__file__).resolve().parents[2]
SHELL_FILES = [*sorted((REPO / "scripts").glob("*.sh")), REPO / "tests" / "e2e" / "kind.sh", REPO / "Makefile"]
# A reader that may stop before its writer has finished: with pipefail, the writer's SIGPIPE fails the pipeline.
EARLY_READER = re.compile(r"\|\s*(head\b|grep\s+(-\w*q|--quiet)|sed\s+-n\s*['\"]?\d*q|awk\s+['\"][^'\"]*exit)")


def _chatty_binary(tmp_path: Path, first_line: str) -> Path:
    """A binary that prints its version, then much more (CoreDNS prints a second line; 1 MB makes SIGPIPE
    certain for any reader that stops after the first)."""
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
    for _ in range(200):
        assert check_version("coredns", "v1.15.0", [str(exe), "-version"]) == "CoreDNS-1.15.0"


def test_version_check_passes_20_times_on_the_built_binaries():
    """Every built component of the tests' set that states a version check, as the build runs it (the demo and CI
    build them; the kind set's, built by `make e2e-kind` only, are checked by that build). The race itself (a
    writer still writing when the reader has its line) is made certain by the chatty binary above, 200 times;
    here each real binary 20 times (200 took 44-50 s of a core in every `make test`)."""
    checked = []
    for c in components.COMPONENTS:
        if c.version_check and c.built() and c.name in components.TESTS:
            argv = [str(c.path()), *c.version_check]
            for _ in range(20):
                check_version(c.name, c.version, argv)
            checked.append(c.name)
    if not checked:
        pytest.skip("no component with a version check is built yet (python -m localcluster.build)")


def test_version_check_names_the_mismatch(tmp_path):
    exe = _chatty_binary(tmp_path, "CoreDNS-1.14.2")
    with pytest.raises(VersionMismatch, match="says 'CoreDNS-1.14.2', the component table says v1.15.0"):
        check_version("coredns", "v1.15.0", [str(exe), "-version"])


def test_a_failing_step_names_component_command_and_log(tmp_path):
    """A `go` that fails stands for any broken build step: the build stops with one line that names the
    component, the command and its log, shows the log's tail, and leaves nothing that looks built."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    go = fake_bin / "go"
    go.write_text("#!/bin/sh\necho 'compile: something broke' >&2\nexit 3\n")
    go.chmod(0o755)
    cache = tmp_path / "cache"
    env = {**os.environ, "EMBEDOPS_CACHE": str(cache), "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "localcluster.build", "etcd"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=REPO)
    assert r.returncode == 3, r.stderr
    log = cache / "logs" / "build-etcd.log"
    failed = [line for line in r.stderr.splitlines() if "FAILED" in line]
    assert len(failed) == 1, r.stderr
    assert "FAILED etcd" in failed[0] and "go build" in failed[0] and "exited 3" in failed[0] and str(log) in failed[0]
    assert "compile: something broke" in log.read_text()
    assert "compile: something broke" in r.stderr  # the log's tail is shown too
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "localcluster.build", "--list"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=REPO)
    assert re.search(r"^etcd\s+v3\.\d+\.\d+\s+no\b", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("jobs", [1, 2])
def test_builds_run_jobs_at_a_time_and_a_failure_stops_what_has_not_started(tmp_path, jobs):
    """Two components asked for: with EMBEDOPS_BUILD_JOBS=2 both builds run at once (their steps overlap in
    time); with 1, the first failure stops the build before the second starts. Either way one FAILED line."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    steps = tmp_path / "steps"
    go = fake_bin / "go"
    go.write_text(f"#!/bin/sh\necho \"start $(date +%s.%N)\" >> {steps}\nsleep 1\n"
                  f"echo \"end $(date +%s.%N)\" >> {steps}\nexit 3\n")
    go.chmod(0o755)
    env = {**os.environ, "EMBEDOPS_CACHE": str(tmp_path / "cache"), "PATH": f"{fake_bin}:{os.environ['PATH']}",
           "EMBEDOPS_BUILD_JOBS": str(jobs)}
    r = subprocess.run([sys.executable, "-m", "localcluster.build", "etcd", "coredns"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode == 3, r.stderr
    assert len([line for line in r.stderr.splitlines() if "FAILED" in line]) == 1, r.stderr
    assert "Traceback" not in r.stderr
    events = sorted((float(t), kind) for kind, t in (line.split() for line in steps.read_text().splitlines()))
    starts = [t for t, kind in events if kind == "start"]
    if jobs == 1:
        assert len(starts) == 1, events
    else:
        first_end = min(t for t, kind in events if kind == "end")
        assert len(starts) == 2 and max(starts) < first_end, events


def test_an_unknown_component_is_refused_by_name():
    r = subprocess.run([sys.executable, "-m", "localcluster.build", "grafana"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2 and "unknown component 'grafana'" in r.stderr and "etcd" in r.stderr, r.stderr


@pytest.mark.parametrize("c", [c for c in components.COMPONENTS
                               if any(isinstance(r, components.GoMain) for r in c.recipes)], ids=lambda c: c.name)
def test_each_recipe_pins_the_components_version(c):
    """A Go main of ours requires its upstream module at the version the table names: the table is the one
    place a version is changed (the test fails until the recipe's go.mod follows)."""
    r = next(r for r in c.recipes if isinstance(r, components.GoMain))
    gomod = (components.RECIPES / r.folder / "go.mod").read_text()
    required = re.search(rf"^\s*(?:require\s+)?{re.escape(r.pins)} (v\S+)", gomod, re.M)
    assert required, f"{r.folder}/go.mod does not require {r.pins}"
    assert required.group(1) == c.version, (c.name, required.group(1), c.version)


def test_the_sets_name_known_components_and_the_demo_builds_less():
    for name, members in components.SETS.items():
        assert members and all(m in components.BY_NAME for m in members), name
    demo, tests = set(components.DEMO), set(components.TESTS)
    assert demo < tests
    assert {"source-controller", "kustomize-controller", "kstatus", "helm", "prometheus", "prometheus-operator"}.isdisjoint(
        demo)  # monitoring's controllers are built for the tests, or for a demo that asks for them
    # what the tests need from their start (`make test` builds the rest beside them): the cluster, not the stacks
    start = set(components.TESTS_START)
    assert demo < start < tests and {"helm"} <= start
    assert start.isdisjoint({"keda-controllers", "traefik", "prometheus", "source-controller", "actionlint"})
    # the build beside the tests knows the order of all it makes: everything of the tests' set not built first
    assert set(components.TESTS_LATE) == tests - start and len(components.TESTS_LATE) == len(tests - start)
    files = components.crd_files()
    assert set(files) == {"servicemonitor", "prometheusrule", "monitoring", "httproute", "scaledobject", "keda"}
    assert set(files["servicemonitor"]) < set(files["monitoring"]) and len(files["monitoring"]) == 10


@pytest.mark.parametrize("c", [c for c in components.COMPONENTS
                               if any(isinstance(r, components.GoPackages) for r in c.recipes)], ids=lambda c: c.name)
def test_each_wrapper_module_pins_the_components_version(c):
    """A wrapper module (recipes/<folder>/go.mod) requires every module its packages come from at the table's
    version."""
    r = next(r for r in c.recipes if isinstance(r, components.GoPackages))
    gomod = (components.RECIPES / r.folder / "go.mod").read_text()
    required = dict(re.findall(r"^\s*(?:require\s+)?(\S+) (v\S+)(?:\s*//.*)?$", gomod, re.M))
    for package, _ in r.binaries:
        module = max((m for m in required if package == m or package.startswith(m + "/")), key=len, default=None)
        assert module, f"{r.folder}/go.mod requires no module of {package}"
        assert required[module] == c.version, (c.name, module, required[module], c.version)


def test_a_test_waits_for_a_component_the_build_beside_the_tests_is_making(tmp_path, monkeypatch):
    """`make test` builds the components its tests need late beside them (scripts/test-lanes.sh): a test asking
    for one waits while that build is making it, and once that build has ended without it, it is told at once
    (its skip, or CI's failure, says so) instead of waiting for ever. A component that build did not plan to
    make (a build into a test's own cache: a cold run's first `make test` timed three build tests out on this)
    is not waited for at all."""
    monkeypatch.setenv("EMBEDOPS_CACHE", str(tmp_path / "cache"))
    status = tmp_path / "build.status"
    monkeypatch.setenv(components.BACKGROUND_BUILD, str(status))
    kstatus, actionlint = components.component("kstatus"), components.component("actionlint")
    (tmp_path / "build.plan").write_text(f"{kstatus.dir}\n{actionlint.dir}\n")

    def build_kstatus():
        time.sleep(0.5)
        kstatus.dir.mkdir(parents=True)
        for f in (*kstatus.provides, *kstatus.aliases):
            (kstatus.dir / f).write_text("")

    builder = threading.Thread(target=build_kstatus)
    t = time.monotonic()
    builder.start()
    assert components.await_background_build(kstatus, poll=0.05) is True
    assert time.monotonic() - t >= 0.5
    builder.join()
    assert components.provided("kstatus") == kstatus.path()

    monkeypatch.setenv("EMBEDOPS_CACHE", str(tmp_path / "a-tests-own-cache"))  # the build still runs
    t = time.monotonic()
    assert components.await_background_build(components.component("etcd"), poll=0.05) is False
    assert time.monotonic() - t < 1
    monkeypatch.setenv("EMBEDOPS_CACHE", str(tmp_path / "cache"))

    status.write_text("2\n")  # the build ended (failed) without actionlint
    t = time.monotonic()
    assert components.await_background_build(actionlint, poll=0.05) is False
    assert time.monotonic() - t < 1
    monkeypatch.delenv(components.BACKGROUND_BUILD)  # no build beside the tests: nothing to wait for
    status.unlink()
    assert components.await_background_build(actionlint, poll=0.05) is False


def test_the_build_beside_the_tests_plans_first_and_builds_in_the_order_the_lanes_need(tmp_path, monkeypatch):
    """The build beside the lanes writes its plan before it builds anything and makes the components in the lanes'
    order of need (the gateway's and monitoring's before Flux's); any other build runs the longest first."""
    from localcluster.build import Builder
    monkeypatch.setenv("EMBEDOPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(components.BACKGROUND_BUILD, raising=False)
    late = [components.component(n) for n in components.TESTS_LATE]
    builder, plan, order = Builder(cache=tmp_path / "cache"), tmp_path / "lanes" / "build.plan", []

    def build(c):
        assert sorted(plan.read_text().splitlines()) == sorted(str(x.dir) for x in late)
        order.append(c.name)
        return True

    monkeypatch.setattr(builder, "build", build)
    builder.build_all(list(reversed(late)), jobs=1, beside_tests=plan)
    assert order == list(components.TESTS_LATE)
    assert order.index("prometheus") < order.index("source-controller")
    order.clear()
    builder.build_all(late, jobs=1)
    assert order[0] == max(components.TESTS_LATE, key=lambda n: COLD_SECONDS.get(n, 0))


def test_the_keda_trim_keeps_the_triggers_the_operator_writes_and_refuses_an_unknown_layout(tmp_path):
    """recipes/keda/trim.py (KEDA built with fewer scalers): on a module laid out as KEDA's, it drops the other
    scalers' files and their cases of the builder's switch, and keeps `default` (KEDA's own error for a type it
    does not know); on any other layout it stops with a message instead of building something else."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("keda_trim", components.RECIPES / "keda" / "trim.py")
    trim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trim)
    scalers, scaling = tmp_path / "pkg" / "scalers", tmp_path / "pkg" / "scaling"
    scalers.mkdir(parents=True)
    scaling.mkdir(parents=True)
    names = [*trim.KEEP, *(f"cloud{i}" for i in range(45))]
    cases = []
    for n in names:
        func = "New" + "".join(p.title() for p in n.split("_")) + "Scaler"
        (scalers / f"{n}_scaler.go").write_text(f"package scalers\n\nfunc {func}(config int) (Scaler, error) {{}}\n")
        cases.append(f'\tcase "{n.replace("_", "-")}":\n\t\treturn scalers.{func}(config)\n')
    (scaling / "scalers_builder.go").write_text(
        "package scaling\n\nfunc buildScaler() {\n\t// TRIGGERS-START\n\tswitch triggerType {\n" + "".join(cases)
        + '\tdefault:\n\t\treturn nil, fmt.Errorf("no scaler found for type: %s", triggerType)\n\t}\n'
        "\t// TRIGGERS-END\n}\n")
    kept = trim.trim(tmp_path)
    assert kept == [f'case "{n.replace("_", "-")}"' for n in trim.KEEP] + ["default"]
    assert {"prometheus", "metrics_api"} <= set(trim.KEEP)  # the triggers render/autoscaling.py writes
    assert sorted(f.name for f in scalers.glob("*_scaler.go")) == sorted(f"{n}_scaler.go" for n in trim.KEEP)
    builder = (scaling / "scalers_builder.go").read_text()
    assert "cloud7" not in builder and "no scaler found" in builder and "TRIGGERS-END" in builder
    with pytest.raises(SystemExit, match="not the layout"):
        trim.trim(tmp_path)  # the same tree again: too few scalers left to be KEDA's
