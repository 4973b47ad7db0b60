"""What the control plane says when one of its processes dies while it starts: which one, how (an exit status
or the signal that killed it) and its last log line, so a kill from outside is told apart from a crash."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from localcluster.controlplane import Cluster


def _cluster(tmp_path) -> tuple[Cluster, dict]:
    c = Cluster(run_dir=tmp_path)
    (tmp_path / "logs").mkdir()
    return c, {"procs": []}


def test_a_killed_process_is_named_with_its_signal(tmp_path):
    c, state = _cluster(tmp_path)
    c.spawn(state, "etcd", [sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(state["procs"][0]["pid"], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"etcd was killed by SIGKILL \(log empty\) while waiting for etcd"):
        c._wait("etcd /health", lambda: False, timeout=10, state=state)


def test_a_crash_is_named_with_its_status_and_last_log_line(tmp_path):
    c, state = _cluster(tmp_path)
    c.spawn(state, "kube-apiserver", [sys.executable, "-c",
                                       "print('starting'); print('F1202 error creating storage factory'); exit(255)"])
    with pytest.raises(RuntimeError) as e:
        c._wait("kube-apiserver /readyz", lambda: False, timeout=10, state=state)
    assert "kube-apiserver exited 255: F1202 error creating storage factory" in str(e.value), str(e.value)


def test_a_live_process_is_never_taken_for_dead(tmp_path):
    """The harness asks the kernel (waitpid) about its own children: a busy starting process is alive however
    its /proc entry reads at that moment."""
    c, state = _cluster(tmp_path)
    c.spawn(state, "etcd", [sys.executable, "-c", "import time; time.sleep(60)"])
    proc = state["procs"][0]
    try:
        assert all(c.exit_status(proc) is None for _ in range(200))
        ticks = iter(range(5))
        c._wait("etcd /health", lambda: next(ticks) == 4, timeout=10, state=state)  # no RuntimeError
    finally:
        os.kill(proc["pid"], signal.SIGKILL)
    assert c.exit_status(proc) in (None, "was killed by SIGKILL")
