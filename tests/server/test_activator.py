"""The activator (server/embedops_server/activator.py), the address of a service that scales to zero, as the
real CLI in its own process in front of the real server: a request that finds no replica is held and
answered once one is up; what it forwards comes back byte for byte; no replica in time is a clear 503."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from localcluster.models import minilm_onnx_dir
from tests.server.conftest import free_port, run_server


@contextlib.contextmanager
def activator(backend_port: int, *args: str, env: dict | None = None):
    import os

    port, admin = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "embedops_server.activator", "--hostname", "127.0.0.1",
                             "--backend", f"http://127.0.0.1:{backend_port}", "--port", str(port),
                             "--admin-port", str(admin), *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{admin}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"activator did not start: {proc.stderr.read()}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    finally:
        proc.terminate()
        proc.wait(10)


def demand(admin: str) -> dict:
    return httpx.get(admin + "/demand", timeout=5).json()


def test_a_request_with_no_replica_is_held_then_answered_byte_for_byte():
    backend = free_port()  # nothing listens there yet: a Service without endpoints refuses the same way
    body = {"inputs": ["scale from zero", "the first request is answered"]}
    with activator(backend, "--activity-window", "2") as (url, admin):
        assert demand(admin) == {"demand": 0, "held": 0, "in_flight": 0, "recent": 0}
        answer: dict = {}

        def first_request():
            t0 = time.monotonic()
            answer["response"] = httpx.post(url + "/embed", json=body, timeout=120)
            answer["seconds"] = time.monotonic() - t0
        client = threading.Thread(target=first_request)
        client.start()
        deadline = time.time() + 10
        while demand(admin)["held"] != 1:
            assert time.time() < deadline, demand(admin)
            time.sleep(0.05)
        assert demand(admin)["demand"] >= 1  # what KEDA's metrics-api trigger reads to wake the Deployment
        time.sleep(1.0)
        assert client.is_alive()  # still held, not refused
        with run_server(port=backend, model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean") as (direct, _):
            client.join(120)
            held = answer["response"]
            expected = httpx.post(direct + "/embed", json=body, timeout=30)
            assert held.status_code == 200 and held.content == expected.content
            assert held.headers["content-type"] == expected.headers["content-type"]
            print(f"held request answered after {answer['seconds']:.1f} s (server start included)")

            # with a replica up, everything passes through as the server answers it, errors included
            for method, path, payload in [("POST", "/v1/embeddings", {"input": "hi", "model": "x"}),
                                          ("POST", "/embed", {"inputs": []}),
                                          ("POST", "/embed", {"wrong": 1}),
                                          ("POST", "/embed_all", {"inputs": ["a long passage " * 60] * 4}),
                                          ("GET", "/info", None), ("GET", "/health", None),
                                          ("GET", "/nope?x=1", None)]:
                via = httpx.request(method, url + path, json=payload, timeout=30)
                straight = httpx.request(method, direct + path, json=payload, timeout=30)
                assert (via.status_code, via.content) == (straight.status_code, straight.content), path
            metrics = httpx.get(admin + "/metrics", timeout=5).text
            assert 'embedops_activator_requests_total{outcome="forwarded"} 8.0' in metrics
            assert "embedops_activator_held_seconds_count 1.0" in metrics
        time.sleep(2.5)  # the activity window: a finished request stops counting as demand
        assert demand(admin) == {"demand": 0, "held": 0, "in_flight": 0, "recent": 0}


def test_no_replica_in_time_is_a_clear_503_and_bad_input_is_refused():
    backend = free_port()
    with activator(backend, "--activation-timeout", "1", "--max-body-bytes", "1000") as (url, admin):
        t0 = time.monotonic()
        r = httpx.post(url + "/embed", json={"inputs": "hello"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "10"
        assert r.json()["error_type"] == "Unhealthy" and "within 1 s" in r.json()["error"]
        assert 1.0 <= time.monotonic() - t0 < 5
        r = httpx.post(url + "/embed", content=b"x" * 5000, timeout=30)
        assert r.status_code == 413 and r.json()["error_type"] == "PayloadTooLarge"
        r = httpx.get(admin + "/anything", timeout=5)
        assert r.status_code == 404 and "/demand" in r.json()["error"]
        metrics = httpx.get(admin + "/metrics", timeout=5).text
        assert 'embedops_activator_requests_total{outcome="timeout"} 1.0' in metrics
        assert 'embedops_activator_requests_total{outcome="too_large"} 1.0' in metrics


def test_the_cli_needs_a_backend():
    r = subprocess.run([sys.executable, "-m", "embedops_server.activator"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert r.returncode == 2 and "--backend" in r.stderr


def test_a_client_that_leaves_while_held_stops_counting_as_demand():
    backend = free_port()
    with activator(backend, "--activity-window", "1") as (url, admin):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/embed", json={"inputs": "hello"}, timeout=httpx.Timeout(1.5, connect=1))
        deadline = time.time() + 10
        while demand(admin) != {"demand": 0, "held": 0, "in_flight": 0, "recent": 0}:
            assert time.time() < deadline, demand(admin)  # KEDA would keep waking the service for nobody
            time.sleep(0.1)
        assert 'embedops_activator_requests_total{outcome="client_gone"} 1.0' in httpx.get(admin + "/metrics").text


def test_a_replica_that_takes_the_request_and_never_answers_is_a_504():
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with activator(silent.getsockname()[1], "--request-timeout", "1") as (url, admin):
            r = httpx.post(url + "/embed", json={"inputs": "hello"}, timeout=30)
            assert r.status_code == 504 and r.json()["error_type"] == "GatewayTimeout"
            assert "within 1 s" in r.json()["error"]


def test_a_body_cut_off_by_the_client_is_not_forwarded():
    backend = free_port()
    with activator(backend) as (url, admin):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"inp\r\n")
            time.sleep(0.3)
        deadline = time.time() + 10
        while 'outcome="client_gone"} 1.0' not in httpx.get(admin + "/metrics").text:
            assert time.time() < deadline
            time.sleep(0.1)
        assert demand(admin)["held"] == 0 and demand(admin)["in_flight"] == 0  # nothing was sent on


def test_without_the_api_key_a_request_is_refused_before_it_counts_as_demand():
    """At a public address: anyone could otherwise keep a scaled-to-zero service's GPUs awake."""
    backend = free_port()
    with activator(backend, "--activation-timeout", "1", env={"API_KEY": "s3cret"}) as (url, admin):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(url + "/embed", json={"inputs": "hello"}, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"] == "missing or invalid API key", r.text
        assert demand(admin) == {"demand": 0, "held": 0, "in_flight": 0, "recent": 0}
        r = httpx.post(url + "/embed", json={"inputs": "hello"}, headers={"Authorization": "Bearer s3cret"},
                       timeout=30)
        assert r.status_code == 503  # held with the key, no replica came: it counted
        assert demand(admin)["recent"] == 1
        metrics = httpx.get(admin + "/metrics", timeout=5).text
        assert 'embedops_activator_requests_total{outcome="unauthorized"} 2.0' in metrics


def test_held_and_in_flight_requests_are_capped_with_429_and_retry_after():
    backend = free_port()
    with activator(backend, "--max-held", "2", "--max-in-flight", "3", "--activation-timeout", "20") as (url, admin):
        results: list = []

        def call():
            try:
                results.append(httpx.post(url + "/embed", json={"inputs": "hello"}, timeout=3).status_code)
            except httpx.TimeoutException:
                results.append("held")
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while demand(admin)["held"] != 2:
            assert time.time() < deadline, demand(admin)
            time.sleep(0.05)
        r = httpx.post(url + "/embed", json={"inputs": "hello"}, timeout=5)  # a third would wait: over --max-held
        assert r.status_code == 429 and r.headers["retry-after"] == "5" and r.json()["error_type"] == "Overloaded"
        for t in threads:
            t.join()
        assert results == ["held", "held"]
        metrics = httpx.get(admin + "/metrics", timeout=5).text
        assert 'embedops_activator_requests_total{outcome="overloaded"} 1.0' in metrics


def test_a_request_a_replica_took_and_never_answered_is_not_sent_again():
    """Issue 53: a connection closed without an answer after the request was sent counted as 'not delivered', so the
    activator sent it again every 0.25 s for up to its activation timeout: a request that kills a replica by memory
    would kill each replica in turn. Now only a refused connection is held and retried; this is answered 502."""
    taken: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))
    backend = server.getsockname()[1]

    def die_on_each_request():  # a replica that reads a request, then dies (the OOM killer) without answering
        server.settimeout(20)
        while True:
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data:
                    taken.append(data)
    t = threading.Thread(target=die_on_each_request, daemon=True)
    t.start()
    try:
        with activator(backend, "--activation-timeout", "10") as (url, admin):
            t0 = time.monotonic()
            r = httpx.post(url + "/embed", json={"inputs": ["too big for any replica"]}, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 502 and r.json()["error_type"] == "BadGateway", r.text
            assert "not sent again" in r.json()["error"] and took < 5, took
            time.sleep(1)
            assert len(taken) == 1, len(taken)  # sent once, never again
            assert demand(admin)["in_flight"] == 0
    finally:
        server.close()
