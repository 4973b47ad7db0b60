"""Backpressure, over-long inputs, client disconnects and SIGTERM under load (bounded in count and time)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from localcluster.models import minilm_dir

from .conftest import cosine, free_port, run_server, wait_healthy

LONG = "Embeddings map sentences to vectors so similar meanings land close together. " * 20  # > 256 tokens


def _metric(url, name):
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_backpressure_429_while_admitted_work_completes(st_model):
    with run_server(model_id=str(minilm_dir()), backend="torch", max_concurrent_requests=8,
                    max_client_batch_size=4, max_batch_requests=2) as (url, st):
        texts = [LONG] * 4
        real = st.service.backend.forward

        def paced(batch):  # at least 20 ms per forward, so the burst always outruns the server
            time.sleep(0.02)
            return real(batch)

        st.service.backend.forward = paced

        async def go():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as c:
                return await asyncio.gather(*[c.post(url + "/embed", json={"inputs": texts}) for _ in range(24)])

        t0 = time.time()
        rs = asyncio.run(go())
        codes = [r.status_code for r in rs]
        ok = [r for r in rs if r.status_code == 200]
        busy = [r for r in rs if r.status_code == 429]
        assert len(ok) + len(busy) == len(rs), codes
        assert ok and busy, codes
        for r in busy:
            assert r.json() == {"error": "Model is overloaded", "error_type": "Overloaded"}
            assert int(r.headers["retry-after"]) >= 1
        ref = st_model.encode(texts[:1], normalize_embeddings=True)
        for r in ok:  # admitted work completed, correctly
            assert cosine(np.array(r.json()), ref).min() >= 0.9999
        assert time.time() - t0 < 60
        assert st.service.engine.in_flight == 0
        assert _metric(url, 'te_request_failure{err="overloaded"}') >= 1
        assert httpx.post(url + "/embed", json={"inputs": "after the storm"}).status_code == 200


def test_input_longer_than_budget_does_not_hang():
    # budget (64) below the model's 256: max input length is clamped, so nothing can wait forever (TEI #723)
    with run_server(model_id=str(minilm_dir()), backend="torch", max_batch_tokens=64) as (url, st):
        assert httpx.get(url + "/info").json()["max_input_length"] == 64
        r = httpx.post(url + "/embed", json={"inputs": LONG, "truncate": False}, timeout=10)
        assert r.status_code == 422 and "less than 64 tokens" in r.json()["error"]
        r = httpx.post(url + "/embed", json={"inputs": [LONG, LONG, "short"]}, timeout=10)
        assert r.status_code == 200 and len(r.json()) == 3
    # with auto-truncate off, the same budget is refused at startup instead of hanging later
    with run_server(wait=False, model_id=str(minilm_dir()), backend="torch", max_batch_tokens=64,
                    auto_truncate=False) as (url, st):
        deadline = time.time() + 60
        while st.load_error is None and time.time() < deadline:
            time.sleep(0.1)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "--max-batch-tokens" in r.json()["error"]


def test_client_disconnect_drops_queued_work():
    with run_server(model_id=str(minilm_dir()), backend="torch", max_batch_requests=1,
                    max_client_batch_size=32) as (url, st):
        real = st.service.backend.forward

        def slow(batch):  # fixed pace, whatever the machine: 32 inputs take >= 1.6 s
            time.sleep(0.05)
            return real(batch)

        st.service.backend.forward = slow

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                keep = asyncio.create_task(c.post(url + "/embed", json={"inputs": [LONG] * 32}))
                await asyncio.sleep(0.1)
                # The second client leaves once its inputs wait in the queue (40 queued: the first request holds
                # at most 32). A fixed 0.3 s client timeout raced the request's parsing and tokenization on a busy
                # machine (the test lanes side by side): it left before anything was queued, and nothing could
                # be dropped.
                async with httpx.AsyncClient(timeout=60) as c2:
                    abandoned = asyncio.create_task(c2.post(url + "/embed", json={"inputs": [LONG + " other"] * 32}))
                    deadline = time.monotonic() + 30
                    while len(st.service.engine.queue) < 40 and time.monotonic() < deadline:
                        assert not abandoned.done(), "the second request was answered before it was queued"
                        await asyncio.sleep(0.01)
                    assert len(st.service.engine.queue) >= 40, len(st.service.engine.queue)
                    abandoned.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await abandoned
                return await keep  # leaving c2's block closed its connection: the server saw the client go

        r = asyncio.run(go())
        assert r.status_code == 200 and len(r.json()) == 32
        deadline = time.time() + 30
        while st.service.engine.in_flight and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        batches = _metric(url, "te_batch_next_size_count")
        dropped = _metric(url, "te_queue_dropped_inputs")
        assert dropped >= 8, dropped  # the abandoned request's queued inputs never ran
        assert batches == 32 + 32 - dropped  # one input per batch here; dropped inputs never formed one
        assert 'te_request_failure{err="dropped"} 1.0' in httpx.get(url + "/metrics").text


def test_sigterm_under_load_loses_no_admitted_request(tmp_path):
    port = free_port()
    env = dict(os.environ, API_KEY="topsecret-should-not-appear", PORT=str(port), MODEL_ID=str(minilm_dir()),
               HOSTNAME="pod-name-7f9c", NUM_THREADS="1", TOKENIZATION_WORKERS="1", MAX_BATCH_REQUESTS="4",
               PYTHONPATH=os.pathsep.join(["server", "."]))
    log = tmp_path / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "embedops_server.cli", "--backend", "torch",
                                 "--hostname", "127.0.0.1", "--graceful-shutdown-timeout", "60", "--json-output"],
                                env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer topsecret-should-not-appear"}
    try:
        wait_healthy(url, timeout=180)

        async def go():
            async with httpx.AsyncClient(timeout=120, headers=auth) as c:
                tasks = [asyncio.create_task(c.post(url + "/embed", json={"inputs": [LONG] * 8})) for _ in range(10)]
                deadline = time.time() + 30
                while time.time() < deadline:  # signal once at least 5 requests (40 inputs) are in flight
                    m = re.search(r"^te_in_flight_inputs ([0-9.]+)", (await c.get(url + "/metrics")).text, re.M)
                    if m and float(m.group(1)) >= 40:
                        break
                    await asyncio.sleep(0.005)
                else:
                    raise AssertionError("requests were not admitted")
                proc.send_signal(signal.SIGTERM)
                t_sig = time.time()
                out = await asyncio.gather(*tasks, return_exceptions=True)
                return out, time.time() - t_sig

        rs, drain_s = asyncio.run(go())
        assert drain_s > 0.02, drain_s  # work really was in flight when the signal came
        codes = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in rs]
        # Admitted requests all complete (200). A request not yet admitted when the signal came may be
        # refused (503, or a connection the closed listener never accepted); nothing else is allowed.
        ok = [r for r in rs if isinstance(r, httpx.Response) and r.status_code == 200]
        assert len(ok) >= 5, codes
        assert all(len(r.json()) == 8 for r in ok)
        for r in rs:
            if isinstance(r, httpx.Response):
                assert r.status_code == 200 or (r.status_code == 503 and r.json()["error_type"] == "Unhealthy"), codes
            else:
                assert isinstance(r, httpx.ConnectError), codes
        print("SIGTERM outcomes:", codes)
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown, so -15 is a clean exit here
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "topsecret" not in text
    assert "draining" in text and "Finished server process" in text
    import json

    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # --json-output: JSON only
    assert {"timestamp", "level", "message"} <= set(lines[0])


def test_after_sigterm_a_pooled_connection_is_served_and_retired(tmp_path):
    """A client's keep-alive connection (a gateway's pool, through a Service's cluster IP that conntrack keeps
    on the terminating pod) sends a request after SIGTERM: it is answered, with ``Connection: close``, and the
    listener takes no new connection. Refusing it (503) or closing the idle connection under it lost requests
    through Traefik in a rollout (docs/cluster.md)."""
    import http.client
    import json

    port = free_port()
    env = dict(os.environ, PORT=str(port), MODEL_ID=str(minilm_dir()), NUM_THREADS="1", TOKENIZATION_WORKERS="1",
               PYTHONPATH=os.pathsep.join(["server", "."]))
    log = tmp_path / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "embedops_server.cli", "--backend", "torch",
                                 "--hostname", "127.0.0.1"], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).parents[2])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=180)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = json.dumps({"inputs": ["pooled"]})
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/embed", body, headers)
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("connection") != "close"
        r.read()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal handled and uvicorn's shutdown begun (its loop ticks every 0.1 s)
        conn.request("POST", "/embed", body, headers)  # the same, pooled connection
        r = conn.getresponse()
        assert r.status == 200, r.read()
        assert r.getheader("connection") == "close"
        assert len(json.loads(r.read())) == 1
        with pytest.raises(OSError):  # the listener is closed: new connections go to other pods
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).request("GET", "/health")
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "draining" in log.read_text()


def test_a_pooled_connection_older_than_its_age_limit_is_retired_after_an_answer(tmp_path):
    """--max-connection-age: a client that keeps its connection open (an SDK's pool) gets its answers on it until
    the connection is that old, then one more answer with ``Connection: close``, and its next request opens a new
    connection, which a Service may send to another pod (the promoted embedding space, an added replica)."""
    import http.client
    import json

    port = free_port()
    env = dict(os.environ, PORT=str(port), MODEL_ID=str(minilm_dir()), NUM_THREADS="1", TOKENIZATION_WORKERS="1",
               PYTHONPATH=os.pathsep.join(["server", "."]))
    with open(tmp_path / "server.log", "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "embedops_server.cli", "--backend", "torch",
                                 "--hostname", "127.0.0.1", "--max-connection-age", "1"], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=180)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body, headers = json.dumps({"inputs": ["pooled"]}), {"Content-Type": "application/json"}

        def call() -> tuple[int, str | None, tuple]:
            conn.request("POST", "/embed", body, headers)
            r = conn.getresponse()
            local = conn.sock.getsockname() if conn.sock else None
            r.read()
            return r.status, r.getheader("connection"), local

        first = call()
        second = call()
        assert first[:2] == (200, None) and second[:2] == (200, None) and first[2] == second[2]  # one connection
        time.sleep(1.2)
        retiring = call()
        assert retiring[:2] == (200, "close"), retiring
        after = call()  # http.client opens a new connection for it
        assert after[:2] == (200, None) and after[2] != first[2], (first, after)
    finally:
        proc.kill()
        proc.wait()
