"""HTTP limits over real sockets (issue 53): what a hostile or broken client can no longer do to the server.

The probes of the issue, against a real server (all-MiniLM-L6-v2 on ONNX Runtime, --max-concurrent-requests 16):
a 1 MiB header and 20,000 headers were answered 200 (TEI 1.9.3: 431); 300 connections sending a header byte every
5 s were all kept open for 70 s (TEI the same). Now: 431 for the first two, 408 and a closed connection at the
request deadline for slow headers, slow bodies and silent connections, 503 past --max-connections, while other
clients keep being served. The figures beside TEI's are in docs/security.md.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from localcluster.models import minilm_onnx_dir

from .conftest import run_server

BODY = json.dumps({"inputs": ["a hostile client"]}).encode()
DEADLINE = 2.0  # --request-timeout here


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _read_all(s: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (or `timeout`)."""
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except (socket.timeout, ConnectionResetError):
        return out


def _status(raw: bytes) -> int | None:
    return int(raw.split()[1]) if raw.startswith(b"HTTP/1.1 ") else None


def test_huge_or_countless_headers_slow_and_silent_clients_and_too_many_connections_are_refused():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", max_concurrent_requests=16,
                    max_client_batch_size=8, request_timeout=DEADLINE, max_connections=40) as (url, _):
        addr = _addr(url)
        ok = httpx.post(url + "/embed", json={"inputs": ["fine"]}, headers={"x-small": "y" * 1000})
        assert ok.status_code == 200

        # one 1 MiB header; 20,000 small ones: 431 with a JSON error, the connection closed
        for extra in (b"X-Big: " + b"a" * (1 << 20) + b"\r\n", b"".join(b"X-%d: v\r\n" % i for i in range(20000))):
            with socket.create_connection(addr) as s:
                try:
                    s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\n" + extra + b"Content-Length: %d\r\n\r\n"
                              % len(BODY) + BODY)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed while we were still sending: read what it said first
                raw = _read_all(s, 10)
            assert _status(raw) == 431, raw[:200]
            assert b'"error_type":"Validation"' in raw

        # slow headers, a slow body, a silent connection: each closed at the deadline with 408 (the silent one
        # with nothing to say but the 408), while a normal client is served meanwhile
        results: dict[str, tuple[int | None, float]] = {}

        def slow(how: str):
            t0 = time.monotonic()
            with socket.create_connection(addr) as s:
                head = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY)
                try:
                    if how == "headers":
                        for b in head:
                            s.sendall(bytes([b]))
                            time.sleep(0.5)
                    elif how == "body":
                        s.sendall(head)
                        for b in BODY:
                            s.sendall(bytes([b]))
                            time.sleep(0.5)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                raw = _read_all(s, 3 * DEADLINE)
            results[how] = (_status(raw), time.monotonic() - t0)
        threads = [threading.Thread(target=slow, args=(how,)) for how in ("headers", "body", "silent")]
        for t in threads:
            t.start()
        time.sleep(0.5)
        served = httpx.post(url + "/embed", json={"inputs": ["served meanwhile"]})
        for t in threads:
            t.join(30)
        assert served.status_code == 200
        for how, (status, took) in results.items():
            assert status == 408 and DEADLINE - 0.1 <= took <= DEADLINE + 1.5, (how, status, took)

        # more connections than --max-connections: a new request is answered 503 at once, then served again
        held = [socket.create_connection(addr) for _ in range(41)]
        try:
            with socket.create_connection(addr) as s:
                s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
                raw = _read_all(s, 5)
            assert _status(raw) == 503, raw[:200]
        finally:
            for s in held:
                s.close()
        time.sleep(0.3)
        assert httpx.post(url + "/embed", json={"inputs": ["back"]}).status_code == 200
