"""Server subprocesses on loopback ports: start, wait for health, peak RSS, stop (only what we started)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    try:
        import psutil

        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except Exception:
        return [pid]


def proc_status_kb(pid: int, key: str) -> int:
    """A field of /proc/<pid>/status in kB (VmRSS, VmHWM = peak RSS); 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_kb(pid: int, key: str) -> int:
    return sum(proc_status_kb(p, key) for p in _tree(pid))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process and its live children have used so far."""
    try:
        import psutil

        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except Exception:  # gone, or no psutil: no figure rather than a wrong one
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child gone meanwhile
            pass
    return total


class Server:
    """A server subprocess. ``health`` is a path polled until it answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, *, health: str = "/health",
                 env: dict | None = None, log_dir: Path | None = None, startup_timeout_s: float = 180.0):
        self.name, self.argv, self.port, self.health = name, argv, port, health
        self.env = {**os.environ, **(env or {})}
        self.log_path = (log_dir or Path("/tmp")) / f"bench-{name}.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")
        self._peak_rss_kb = 0
        self._stop_sampler = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = t0 + self.startup_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during startup; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:  # embedops answers 503 with the reason once loading has failed
                reason = e.read().decode(errors="replace")
                if "loading failed" in reason:
                    self.stop()
                    raise RuntimeError(f"{self.name} failed to load: {reason[:2000]}") from None
            except Exception:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"{self.name} not healthy after {self.startup_timeout_s:.0f}s; "
                               f"log tail:\n{self.log_tail()}")
        self.startup_s = time.perf_counter() - t0
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:  # children's VmHWM is lost when they exit, so sample too
        while not self._stop_sampler.wait(0.5):
            if self.proc is None or self.proc.poll() is not None:
                return
            self._peak_rss_kb = max(self._peak_rss_kb, tree_kb(self.proc.pid, "VmRSS"))

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid) if self.proc else 0.0

    def rss_mb(self) -> float:
        return tree_kb(self.proc.pid, "VmRSS") / 1024 if self.proc else 0.0

    def peak_rss_mb(self) -> float:
        if not self.proc:
            return 0.0
        return max(self._peak_rss_kb, tree_kb(self.proc.pid, "VmHWM")) / 1024

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 5.0) -> str | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.read().decode(errors="replace")
        except Exception:
            return None

    def stop(self) -> None:
        self._stop_sampler.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # our own session: the server and its children only
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
