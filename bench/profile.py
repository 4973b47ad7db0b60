"""``--pyspy``: sample the embedops server with py-spy while the load runs, and summarize where time goes.

Writes, per (target, scenario), the raw collapsed stacks (``results/pyspy-*.txt``, flamegraph.pl or
speedscope can read them) and a summary of the top frames by self and inclusive samples
(``results/pyspy-*.summary.txt``), also printed. Only non-idle samples are taken, so the percentages are
shares of the server's busy CPU time across all its threads.
"""
from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PROFILED = ("1-online", "2-c16", "2-c64", "3-ingest", "5-mixed")


def pyspy_exe() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


def summarize_collapsed(path: Path, top: int = 25) -> str:
    """Top frames of a py-spy raw (collapsed) file: 'frame;frame;frame count' per line."""
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        if frames and frames[0].startswith(("thread", "process")):
            threads[frames[0]] += n
        fr = [f for f in frames if not f.startswith(("thread", "process"))]
        if fr:
            self_c[_short(fr[-1])] += n
        for f in set(_short(f) for f in fr):
            incl[f] += n
    if not total:
        return "no samples"
    lines = [f"{total} samples"]
    if threads:
        lines.append("by thread: " + ", ".join(f"{k} {v / total:.0%}" for k, v in threads.most_common(6)))
    lines.append("self:")
    lines += [f"  {v / total:6.1%}  {k}" for k, v in self_c.most_common(top)]
    lines.append("inclusive:")
    lines += [f"  {v / total:6.1%}  {k}" for k, v in incl.most_common(top)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"; site-packages trimmed
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    f = loc.split(":")[0]
    parts = f.split("/")
    if "site-packages" in parts:
        f = "/".join(parts[parts.index("site-packages") + 1:][:3])
    elif "embedops_server" in parts:
        f = "/".join(parts[parts.index("embedops_server"):])
    else:
        f = parts[-1]
    return f"{name} ({f})"


def attach_pyspy(runner) -> None:
    """Wrap ``runner.http`` so embedops runs of the profiled scenarios are sampled."""
    from .logs import log

    exe = pyspy_exe()
    if not exe:
        runner.errors["py-spy"] = "py-spy not installed (pip install py-spy)"
        return
    inner = runner.http

    def http(scenario, key, t, *a, **kw):
        if not (key.startswith("embedops") and scenario in PROFILED):
            return inner(scenario, key, t, *a, **kw)
        out = Path(runner.out) / f"pyspy-{key.replace('/', '-')}-{scenario}.txt"
        p = subprocess.Popen([exe, "record", "--pid", str(t.server.proc.pid), "--format", "raw", "--rate", "250",
                              "--output", str(out), "--threads", "--nonblocking"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        time.sleep(1.0)
        try:
            return inner(scenario, key, t, *a, **kw)
        finally:
            os.kill(p.pid, signal.SIGINT)
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                err = b""
            if out.exists():
                s = summarize_collapsed(out)
                out.with_suffix(".summary.txt").write_text(s)
                log(f"py-spy {key} {scenario}:\n" + "\n".join(s.splitlines()[:22]))
            else:
                runner.errors[f"py-spy {key} {scenario}"] = (err or b"").decode(errors="replace")[-500:]

    runner.http = http
