"""Issue 58: an operator restarted with its fleet present stays up under a memory limit it held on the way up.

A restart is the moment an operator's memory peaks: its caches list every object at once, and every service is
reconciled again. Before this issue's changes the restart peaked far above the steady state (at 1,000 services
278 MB against 148 MB through the ramp: every listed child lacked its apiVersion and kind, so every Deployment
and Service was applied again, and the cache held each object as Python dicts), so an operator sized for its
fleet crash-looped on its next restart: the kernel killed it, the fleet went unreconciled.

Here: an operator process in a memory cgroup of its own lists its (empty) namespace, and the cgroup's peak then is
its base; it creates the fleet (N services on the kwok nodes) and stops; a new operator process starts inside a
cgroup v1 memory cgroup limited to that base plus PER_SERVICE per service, every service present. It must reconcile
every service once, send no write to any child, and be alive at the end (the OOM killer ends it with SIGKILL). The
base is measured, not fixed: it differs between machines and library versions; the cost per service is what the
change is about. The same test against the operator before it: killed under the limit (exit -9), and it wrote every
Deployment and Service again.
"""
from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.operator_process import (CPU_SPEC, GROUP, PLURAL, VERSION, OperatorProcess, es_body,
                                                operator_env, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
N = 300
# The restart's limit: the operator's base (its caches listed, nothing in them) plus this per service. Measured here
# (2026-12-07, cgroup peaks over the base at N = 300): 80 KiB per service now (one listing at a time, pages of 100,
# objects held encoded, nothing re-applied), 203 KiB before (and 1,296 writes): the limit sits between them. Per
# service it is above the fleet-scale figure (about 20 KiB at 1,000 services) because a restart's transients (a
# page of whole objects, four reconciles at once) do not shrink with the fleet.
PER_SERVICE = 128 << 10
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def rss_peak(pid: int) -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) << 10


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(r"^" + re.escape(name) + r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)", text, re.M))


def scrape(address: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def child_writes(kube) -> float:
    """Server-side applies, patches, updates and creates of Deployments and Services the API server counted."""
    api = kube.api_client()
    try:
        resp = api.call_api("GET", api.configuration.host + "/metrics", header_params={"Accept": "*/*"},
                            _request_timeout=30)
        text = resp.read().decode()
    finally:
        api.close()
    total = 0.0
    for labels, value in re.findall(r"^apiserver_request_total(\{[^}]*\})\s+([0-9.eE+-]+)", text, re.M):
        if re.search(r'resource="(deployments|services)"', labels) and 'subresource=""' in labels and \
                re.search(r'verb="(APPLY|PATCH|UPDATE|POST)"', labels):
            total += float(value)
    return total


class MemoryCgroup:
    """A cgroup v1 memory cgroup with a limit; a child process joins it before it starts (root only)."""

    def __init__(self, name: str, limit: int):
        self.path = CGROUP_ROOT / name
        self.path.mkdir(exist_ok=True)
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError:
            self.path.rmdir()
            raise
        self.limit = limit

    def join_self(self) -> None:
        """Put the calling process in the cgroup: a child's preexec_fn, so all it allocates counts."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def failcnt(self) -> int:
        return int((self.path / "memory.failcnt").read_text())

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # a process still in it: it is exiting
                time.sleep(0.1)


def cgroup_v1_memory() -> str | None:
    """Why this machine cannot run the test (None: it can)."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return "the memory cgroup is not writable (not root)"
    return None


def test_a_restart_with_the_fleet_present_stays_under_a_limit_that_killed_the_operator_before(kube, tmp_path):
    reason = cgroup_v1_memory()
    if reason:
        pytest.skip(reason)
    from localcluster.pki import free_port

    with operator_env(kube, tmp_path, "memlimit") as e:
        ns = e.ns
        ramp_metrics = f"127.0.0.1:{free_port()}"
        ramp_group = MemoryCgroup(f"embedops-test-{os.getpid()}-ramp", 4 << 30)
        group = None
        try:
            ramp = OperatorProcess("ramp", e.kubeconfig, tmp_path, ["-n", ns, "--resync-seconds", "30",
                                                                    f"--metrics-address={ramp_metrics}",
                                                                    "--metrics-auth=none"])
            ramp.preexec = ramp_group.join_self
            e.procs.append(ramp.start())
            wait_for("the first operator started", lambda: "watch caches synced" in ramp.log(), 60)
            time.sleep(2)
            base = ramp_group.max_usage()  # the operator with its caches listed and nothing to cache
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda i: e.custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, es_body(ns, f"svc-{i:03d}", CPU_SPEC)), range(N)))

            def reconciled() -> bool:
                items = e.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
                return len(items) == N and all((o.get("status") or {}).get("observedGeneration") ==
                                               o["metadata"]["generation"] for o in items)
            wait_for(f"{N} services reconciled", reconciled, 400, interval=2.0)
            wait_for("the first operator's queue drained", lambda: metric(
                scrape(ramp_metrics), "embedops_operator_workqueue_depth") == 0, 120)
            time.sleep(3)  # the last pod events
            ramp_peak = ramp_group.max_usage()
            assert ramp.stop() == 0, ramp.log()[-3000:]

            limit = base + N * PER_SERVICE
            group = MemoryCgroup(f"embedops-test-{os.getpid()}", limit)
            writes_before = child_writes(kube)
            restart_metrics = f"127.0.0.1:{free_port()}"
            restarted = OperatorProcess("restarted", e.kubeconfig, tmp_path, [
                "-n", ns, "--resync-seconds", "30", f"--metrics-address={restart_metrics}", "--metrics-auth=none"])
            restarted.preexec = group.join_self
            e.procs.append(restarted.start())
            said = (f"base {base / 2**20:.1f} MiB, ramp peak {ramp_peak / 2**20:.1f} MiB, limit {limit / 2**20:.1f} "
                    f"MiB ({N} x {PER_SERVICE >> 10} KiB over the base)")

            def drained() -> bool:
                if not restarted.alive():
                    return True  # said below, at once
                text = scrape(restart_metrics)
                return metric(text, "embedops_operator_reconciles_total") >= N and \
                    metric(text, "embedops_operator_workqueue_depth") == 0
            wait_for("every service reconciled by the restarted operator", drained, 240, interval=1.0)
            time.sleep(5)
            assert restarted.alive(), (f"the restarted operator died (exit {restarted.proc.returncode}; -9: the OOM "
                                       f"killer): {said}\n" + restarted.log()[-3000:])
            assert "Traceback" not in restarted.log(), restarted.log()[-3000:]
            writes = child_writes(kube) - writes_before
            print(f"\n{said}; restart peak {group.max_usage() / 2**20:.1f} MiB; limit hits {group.failcnt()}; "
                  f"child writes {writes:.0f}")
            assert writes == 0, f"{writes} writes of Deployments or Services by a restart that changed nothing"
        finally:
            for p in e.procs:
                p.stop()
            ramp_group.remove()
            if group is not None:
                group.remove()
