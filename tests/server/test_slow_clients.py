"""Slow and idle clients cost the server little: a request trickled over a minute holds no admission budget and no
inference slot until its body is complete (others are served meanwhile), and 2,000 idle keep-alive connections
add well under 100 MB to the server's RSS."""
from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from localcluster.models import minilm_dir

from .conftest import free_port, run_server, wait_healthy

REPO = Path(__file__).resolve().parents[2]
TRICKLE_S = 30.0  # six times uvicorn's keep-alive timeout: long past any idle limit, and 30 s of CI less than 60
BUDGET = 4  # --max-concurrent-requests: one request of 4 inputs takes all of it
BODY = json.dumps({"inputs": ["slow clients", "hold", "no", "budget"]}).encode()


def _recv_response(s: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a content-length (what the server sends); (status, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(head.split()[1]), body[:length]


class Trickler(threading.Thread):
    """A client that spreads one POST /embed over TRICKLE_S seconds, a byte at a time: its request line and
    headers ("headers"), its body under a content-length ("body"), or its body as 1-byte chunks ("chunked")."""

    def __init__(self, url: str, how: str, seconds: float):
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.addr, self.how, self.seconds = (host, int(port)), how, seconds
        self.status, self.body, self.error, self.took = None, b"", None, 0.0

    def run(self):
        head = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        if self.how == "chunked":
            head += b"Transfer-Encoding: chunked\r\n\r\n"
            slow = [b"1\r\n" + BODY[i:i + 1] + b"\r\n" for i in range(len(BODY))] + [b"0\r\n\r\n"]
            fast, rest = head, b""
        else:
            head += b"Content-Length: %d\r\n\r\n" % len(BODY)
            if self.how == "headers":
                fast, slow, rest = b"", [head[i:i + 1] for i in range(len(head))], BODY
            else:
                fast, slow, rest = head, [BODY[i:i + 1] for i in range(len(BODY))], b""
        t0 = time.monotonic()
        try:
            with socket.create_connection(self.addr, timeout=self.seconds + 60) as s:
                s.sendall(fast)
                for i, piece in enumerate(slow):
                    time.sleep(max(0.0, t0 + self.seconds * (i + 1) / len(slow) - time.monotonic()))
                    s.sendall(piece)
                s.sendall(rest)
                self.took = time.monotonic() - t0
                self.status, self.body = _recv_response(s)
        except Exception as e:  # reported by the test
            self.error = repr(e)


@pytest.mark.slow
def test_trickling_clients_hold_no_admission_budget_or_inference_slot():
    # (the request deadline, which closes such clients at --request-timeout, is test_http_limits.py's: here they
    # must finish, to show what they hold meanwhile)
    with run_server(model_id=str(minilm_dir()), backend="torch", max_concurrent_requests=BUDGET,
                    max_client_batch_size=BUDGET, batch_lane_share=1.0, request_timeout=3 * TRICKLE_S) as (url, st):
        engine = st.service.engine
        # each ends 2 s after the previous one, so that their requests, each needing the whole budget, do not
        # compete with each other (or with ours, which stop 3 s before the first ends) once complete
        tricklers = [Trickler(url, how, TRICKLE_S + 2 * i)
                     for i, how in enumerate(("headers", "body", "chunked") * 2)]
        t0 = time.monotonic()
        for t in tricklers:
            t.start()
        served, samples = 0, []
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < t0 + TRICKLE_S - 3:
                # one request that needs the whole budget: 429 if any trickler held part of it
                r = c.post(url + "/embed", json={"inputs": ["served", "while", "others", "trickle"]})
                assert r.status_code == 200, r.text
                served += 1
                metrics = c.get(url + "/metrics").text
                gauge = {m: float(re.search(rf"^{m} (\S+)$", metrics, re.M).group(1))
                         for m in ("te_in_flight_inputs", "te_queue_size")}
                samples.append((engine.in_flight, len(engine.queue), gauge["te_in_flight_inputs"],
                                gauge["te_queue_size"]))
                time.sleep(1)
        for t in tricklers:
            t.join(TRICKLE_S + 60)
        for t in tricklers:  # each was a real request: answered once complete
            assert t.error is None and t.status == 200, (t.how, t.error, t.status, t.body[:200])
            assert len(json.loads(t.body)) == 4 and t.took >= TRICKLE_S - 1, (t.how, t.took)
        assert served >= 15, served
        assert set(samples) == {(0, 0, 0.0, 0.0)}, samples  # nothing admitted or queued for the tricklers
        assert engine.in_flight == 0
        print(f"trickled {len(tricklers)} requests over {min(t.took for t in tricklers):.0f}-"
              f"{max(t.took for t in tricklers):.0f} s; served {served} full-budget requests meanwhile")


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _established(pid: int, port: int) -> int:
    import psutil

    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)


@pytest.mark.slow
def test_2000_idle_keepalive_connections_add_under_100_mb(tmp_path):
    n = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 1024
    if soft < want:  # this process opens the sockets; the server, started below, inherits the limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    if min(want, hard) < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "server"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    # The real CLI (uvicorn as deployed: keep-alive timeout 30 s), in its own process so its RSS is its own.
    proc = subprocess.Popen([sys.executable, "-m", "embedops_server.cli", "--model-id", str(minilm_dir()),
                             "--backend", "torch", "--port", str(port), "--hostname", "127.0.0.1",
                             "--num-threads", "1", "--tokenization-workers", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "wb"))
    socks: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, dead=lambda: proc.poll() is not None and f"server exited {proc.returncode}")
        with httpx.Client() as c:  # warm: the allocator's pools after ordinary traffic
            for _ in range(20):
                assert c.post(url + "/embed", json={"inputs": ["warm up", "the allocator"]}).status_code == 200
        time.sleep(1)
        before = _rss(proc.pid)
        t0 = time.monotonic()
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        for s in socks:  # one request each, so every connection is an idle keep-alive one afterwards
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in socks:
            assert _recv_response(s)[0] == 200
        opened = time.monotonic() - t0
        time.sleep(2)
        assert opened + 2 < 25, f"took {opened:.0f} s: the server's 30 s keep-alive timeout would close them"
        held = _established(proc.pid, port)
        after = _rss(proc.pid)
        grew = (after - before) / 2 ** 20
        assert held >= n, held
        assert grew < 100, f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MB with {held} idle connections"
        assert httpx.post(url + "/embed", json={"inputs": "still serving"}, timeout=30).status_code == 200
        print(f"{held} idle keep-alive connections: RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MB "
              f"(+{grew:.1f} MB, {grew * 1024 / n:.1f} KiB each); opened in {opened:.1f} s")
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
