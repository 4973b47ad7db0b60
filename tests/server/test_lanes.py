"""Interactive and batch lanes (core/lanes.py): a query overtakes queued ingestion work, the batch lane keeps its
share, and each lane is refused on its own limit. On the real server (MiniLM, ONNX Runtime: an engine per lane)
with forwards paced to a fixed minimum so that the order does not depend on the machine's speed."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from embedops_server.core.errors import EngineError
from embedops_server.core.lanes import BATCH, INTERACTIVE, choose_lane
from embedops_server.core.queue import URGENT_RUN, BatchQueue, Entry
from localcluster.models import minilm_onnx_dir

from .conftest import run_server
from .queue_support import Req

PASSAGE = "Ingestion sends long passages in large lots and nobody waits for one of them in particular. " * 8
QUERY = "what is a batch lane"


def test_the_lane_is_the_clients_word_else_the_services_default():
    assert choose_lane("batch", 1, "auto", 4) == BATCH
    assert choose_lane(" Interactive ", 32, "auto", 4) == INTERACTIVE
    assert choose_lane(None, 4, "auto", 4) == INTERACTIVE
    assert choose_lane(None, 5, "auto", 4) == BATCH
    assert choose_lane(None, 50, "auto", 4, query=True) == INTERACTIVE  # a rerank: one question's candidates
    assert choose_lane(None, 1, "batch", 4) == BATCH  # a service whose every client is ingestion
    with pytest.raises(EngineError) as e:
        choose_lane("urgent", 1, "auto", 4)
    assert e.value.kind == "Validation" and "interactive, batch" in e.value.message


def test_one_queue_for_both_lanes_puts_urgent_inputs_first_and_keeps_the_batch_share():
    """The shared mode (torch, GPU): urgent entries head the next batch, the batch lane heads one in
    URGENT_RUN + 1 while urgent work keeps coming."""
    q = BatchQueue(64, 1)  # one input per batch: the order of batches is the order of heads
    batch = [Entry(Req(), i, [1] * 8, [0] * 8) for i in range(3)]
    q.put_many(batch)
    urgent = [Entry(Req(), i, [1] * 8, [0] * 8, urgent=True) for i in range(2 * URGENT_RUN + 2)]
    q.put_many(urgent)
    heads = []
    while len(q):
        b, _ = q.form()
        heads.append("u" if b[0].urgent else "b")
    # arrival order was b b b u u u ...: the urgent ones go first, URGENT_RUN in a row, then one batch input
    assert heads == ["u"] * URGENT_RUN + ["b"] + ["u"] * URGENT_RUN + ["b"] + ["u"] * 2 + ["b"], heads


class Pace:
    """Wraps the backend's forward: every forward lasts at least `seconds` and is recorded as (lane of the
    thread that ran it, start, end, rows)."""

    def __init__(self, backend, seconds: float):
        self.real, self.seconds = backend.forward, seconds
        self.forwards: list[tuple[str, float, float, int]] = []
        self.lock = threading.Lock()
        backend.forward = self

    def __call__(self, batch):
        t0 = time.perf_counter()
        out = self.real(batch)
        left = self.seconds - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        lane = BATCH if threading.current_thread().name.endswith(BATCH) else INTERACTIVE
        with self.lock:
            self.forwards.append((lane, t0, time.perf_counter(), int((batch.lengths > 0).sum())))
        return out


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _query_beside_ingestion(url: str, st, clients: int = 3):
    """`clients` ingestion requests of 32 passages; once their inputs wait in the queue, one query. Returns
    (query response, its latency, the time it was sent, the ingestion responses)."""
    async with httpx.AsyncClient(timeout=120) as c:
        ingest = [asyncio.create_task(c.post(url + "/embed", json={"inputs": [PASSAGE + str(i)] * 32}))
                  for i in range(clients)]
        deadline = time.monotonic() + 60
        while st.service.lanes.queued() < 48 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert st.service.lanes.queued() >= 48, "the ingestion inputs never queued up"
        sent = time.perf_counter()
        r = await c.post(url + "/embed", json={"inputs": QUERY})
        latency = time.perf_counter() - sent
        return r, latency, sent, await asyncio.gather(*ingest)


def test_a_query_overtakes_queued_ingestion_work_on_the_real_server():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", max_batch_requests=8,
                    max_forward_tokens=0) as (url, st):
        assert st.service.lanes.separate and st.service.lanes.enabled
        pace = Pace(st.service.backend, 0.05)
        r, latency, sent, ingest = asyncio.run(_query_beside_ingestion(url, st))
        assert r.status_code == 200 and r.headers["embedops-lane"] == INTERACTIVE
        assert all(x.status_code == 200 and len(x.json()) == 32 for x in ingest)  # no accepted work lost
        assert {x.headers["embedops-lane"] for x in ingest} == {BATCH}
        forwards = sorted(pace.forwards, key=lambda f: f[1])
        query = [f for f in forwards if f[0] == INTERACTIVE and f[1] >= sent]
        assert len(query) == 1 and query[0][3] == 1, forwards
        # batch forwards still started after the query's: it overtook queued work instead of waiting for it
        later = [f for f in forwards if f[0] == BATCH and f[1] > query[0][2]]
        assert len(later) >= 3, forwards
        assert latency < 1.0, latency  # at most one paced batch forward beside it, not the ~12 queued
        metrics = httpx.get(url + "/metrics").text
        assert _metric(metrics, 'embedops_lane_requests{lane="interactive"}') >= 1
        assert _metric(metrics, 'embedops_lane_requests{lane="batch"}') >= 3
        assert _metric(metrics, 'embedops_lane_request_duration_count{lane="batch"}') >= 3


def test_without_lanes_the_same_query_waits_for_the_work_queued_before_it():
    """The control: one FIFO queue (TEI's behaviour, `--lanes false`)."""
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", max_batch_requests=8,
                    max_forward_tokens=0, lanes=False) as (url, st):
        assert not st.service.lanes.separate
        pace = Pace(st.service.backend, 0.05)
        r, latency, sent, ingest = asyncio.run(_query_beside_ingestion(url, st))
        assert r.status_code == 200 and all(x.status_code == 200 for x in ingest)
        queued_first = [f for f in pace.forwards if f[1] >= sent and f[3] > 1]
        assert latency > 0.3 and len(queued_first) >= 3, (latency, pace.forwards)  # the queued inputs first


def test_the_batch_lane_keeps_going_under_a_steady_query_load():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", max_batch_requests=4,
                    max_forward_tokens=0) as (url, st):
        pace = Pace(st.service.backend, 0.02)

        async def go():
            stop = time.monotonic() + 60
            async with httpx.AsyncClient(timeout=60) as c:
                async def queries():
                    n = 0
                    while not done.is_set() and time.monotonic() < stop:
                        assert (await c.post(url + "/embed", json={"inputs": QUERY + str(n)})).status_code == 200
                        n += 1
                    return n

                done = asyncio.Event()
                load = [asyncio.create_task(queries()) for _ in range(4)]
                await asyncio.sleep(0.3)
                r = await c.post(url + "/embed", json={"inputs": [PASSAGE] * 16})
                done.set()
                return r, sum(await asyncio.gather(*load))

        r, answered = asyncio.run(go())
        assert r.status_code == 200 and len(r.json()) == 16
        lanes = {f[0] for f in pace.forwards}
        assert lanes == {INTERACTIVE, BATCH} and answered > 20


def test_each_lane_is_refused_on_its_own_limit():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", max_concurrent_requests=40,
                    batch_lane_share=0.5, max_client_batch_size=16, max_batch_requests=2) as (url, st):
        Pace(st.service.backend, 0.05)

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                held = asyncio.create_task(c.post(url + "/embed", json={"inputs": [PASSAGE] * 16}))
                deadline = time.monotonic() + 30
                while st.service.lanes.in_flight_of(BATCH) < 16 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                over = await c.post(url + "/embed", json={"inputs": [PASSAGE] * 8})  # 24 > 20: the batch limit
                forced = await c.post(url + "/embed", json={"inputs": QUERY}, headers={"embedops-lane": "batch"})
                query = await c.post(url + "/embed", json={"inputs": [QUERY] * 4})  # 20 + 4 <= 40
                bad = await c.post(url + "/embed", json={"inputs": QUERY}, headers={"embedops-lane": "fast"})
                return await held, over, forced, query, bad

        held, over, forced, query, bad = asyncio.run(go())
        assert held.status_code == 200
        assert over.status_code == 429 and over.json()["error"] == "Model is overloaded (batch lane)"
        assert int(over.headers["retry-after"]) >= 1
        assert forced.status_code == 200 and forced.headers["embedops-lane"] == BATCH  # 16 + 1 <= 20
        assert query.status_code == 200 and query.headers["embedops-lane"] == INTERACTIVE
        assert bad.status_code == 422 and "embedops-lane" in bad.json()["error"]
        metrics = httpx.get(url + "/metrics").text
        assert _metric(metrics, 'embedops_lane_overloaded{lane="batch"}') >= 1
        assert _metric(metrics, 'embedops_lane_overloaded{lane="interactive"}') == 0
        info = httpx.get(url + "/info").json()["lanes"]
        assert info == {"enabled": True, "separate": True, "default": "auto", "auto_max_inputs": 4,
                        "batch_limit": 20, "batch_nice": 10}


def test_the_batch_port_is_the_batch_lanes_address():
    """--batch-port: the same API on a second port whose requests default to the batch lane (the operator's
    <name>-batch Service), the header still deciding where a client sends one."""
    from .conftest import free_port

    batch_port = free_port()
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", batch_port=batch_port) as (url, st):
        batch_url = f"http://127.0.0.1:{batch_port}"
        one = httpx.post(batch_url + "/embed", json={"inputs": QUERY})
        assert one.status_code == 200 and one.headers["embedops-lane"] == BATCH
        asked = httpx.post(batch_url + "/v1/embeddings", json={"input": QUERY, "model": "m"},
                           headers={"embedops-lane": "interactive"})
        assert asked.status_code == 200 and asked.headers["embedops-lane"] == INTERACTIVE
        main = httpx.post(url + "/embed", json={"inputs": QUERY})
        assert main.status_code == 200 and main.headers["embedops-lane"] == INTERACTIVE
        assert one.json() == main.json()  # one model, one space, whichever the lane


def test_a_request_larger_than_its_lanes_limit_is_refused_as_invalid_never_429():
    """Issue 53: on an idle server, a request of more inputs than its lane may ever hold in flight was answered
    429 + Retry-After forever (clients retried, nothing queued, KEDA never scaled). The settings refuse such a
    --max-client-batch-size at start; the lanes refuse such a request as invalid, whoever calls them."""
    import types

    from embedops_server.core.errors import OVERLOADED, VALIDATION
    from embedops_server.core.lanes import Lanes

    engine = types.SimpleNamespace(in_flight=0, max_concurrent=16, retry_after=lambda: 1, urgent_lane=None)
    engine.hold = lambda n: setattr(engine, "in_flight", engine.in_flight + n)
    lanes = Lanes.one(engine, enabled=True, batch_limit=12)
    with pytest.raises(EngineError) as err:
        lanes.admit(BATCH, 13)
    assert err.value.kind == VALIDATION and "batch size 13 > the batch lane's limit of inputs in flight 12" in \
        err.value.message
    lanes.admit(INTERACTIVE, 13)  # the interactive lane holds up to the whole limit
    with pytest.raises(EngineError) as err:
        lanes.admit(INTERACTIVE, 4)  # 17 > 16 in flight: overloaded, a retry can pass
    assert err.value.kind == OVERLOADED
