"""Every error code, in TEI's shape (OpenAI's on OpenAI routes); bad input never yields a 500 or a hang."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .conftest import run_server

AUTH = {"Authorization": "Bearer s3cret-key"}


def _err(r, status, kind):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["error_type"] == kind and body["error"], body
    return body["error"]


def test_empty_inputs_400(minilm_torch, reranker):
    _err(httpx.post(minilm_torch + "/embed", json={"inputs": []}), 400, "Empty")
    _err(httpx.post(reranker + "/rerank", json={"query": "q", "texts": []}, headers=AUTH), 400, "Empty")
    r = httpx.post(minilm_torch + "/v1/embeddings", json={"input": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, needle", [
    ({"inputs": ["x"] * 65}, "batch size 65 > maximum allowed batch size 64"),
    ({"inputs": "word " * 300, "truncate": False}, "must have less than 256 tokens"),
    ({"inputs": "x", "dimensions": 0}, "dimensions"),
    ({"inputs": "x", "dimensions": 385}, "dimensions"),
    ({"inputs": 12.5}, "inputs"),
    ({"inputs": [["a"]]}, "inputs"),
    ({"inputs": "x", "truncation_direction": "up"}, "truncation_direction"),
    ({"inputs": "x", "prompt_name": "query"}, "prompt_name"),
    ({"inputs": [999999]}, "token id out of range"),
    ({"inputs": "x" * 70000, "truncate": False}, "characters"),
    ({"nothing": 1}, "inputs"),
])
def test_validation_422(minilm_torch, body, needle):
    msg = _err(httpx.post(minilm_torch + "/embed", json=body, timeout=30), 422, "Validation")
    assert needle in msg and "union[" not in msg and len(msg) < 200


def test_malformed_bodies_are_4xx(minilm_torch):
    u = minilm_torch + "/embed"
    hdr = {"content-type": "application/json"}
    _err(httpx.post(u, content=b'{"inputs": ["a",', headers=hdr), 422, "Validation")
    r = httpx.post(u, content=b'{"inputs": "\xff\xfe bad utf8"}', headers=hdr)
    assert 400 <= r.status_code < 500 and "error_type" in r.json()
    _err(httpx.post(u, content=b"[1, 2]", headers=hdr), 422, "Validation")
    _err(httpx.post(u, content=b"", headers=hdr), 422, "Validation")
    r = httpx.post(minilm_torch + "/v1/embeddings", content=b"{oops", headers=hdr)
    assert r.status_code == 422 and "message" in r.json()["error"]
    _err(httpx.post(minilm_torch + "/nope", json={}), 404, "NotFound")
    _err(httpx.get(minilm_torch + "/embed"), 405, "MethodNotAllowed")
    # a lone surrogate is valid JSON (\ud800) but not text: named as such, not as the tokenizer's signature
    r = httpx.post(u, content=b'{"inputs": ["fine", "bad \\ud800 text"]}', headers=hdr)
    assert r.status_code == 422 and "text 1 is not valid Unicode" in r.json()["error"], r.text
    r = httpx.post(u.replace("/embed", "/similarity"), headers=hdr,
                   content=b'{"inputs": {"source_sentence": "a", "sentences": ["\\udfff"]}}')
    assert r.status_code == 422 and "not valid Unicode" in r.json()["error"], r.text
    # the server is unaffected
    assert httpx.post(u, json={"inputs": "still fine"}).status_code == 200


def test_payload_limit_413(minilm_torch):
    big = json.dumps({"inputs": ["x" * 1000] * 2100}).encode()
    assert len(big) > 2_000_000
    r = httpx.post(minilm_torch + "/embed", content=big, headers={"content-type": "application/json"})
    _err(r, 413, "PayloadTooLarge")

    def chunks():  # no content-length: chunked transfer encoding
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(minilm_torch + "/embed", content=chunks(), headers={"content-type": "application/json"})
    _err(r, 413, "PayloadTooLarge")

    small = json.dumps({"inputs": "chunked but small"}).encode()
    r = httpx.post(minilm_torch + "/embed", content=iter([small[:5], small[5:]]),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200


def test_api_key_401(reranker):
    body = {"query": "q", "texts": ["a"]}
    _err(httpx.post(reranker + "/rerank", json=body), 401, "Unauthorized")
    _err(httpx.post(reranker + "/rerank", json=body, headers={"Authorization": "Bearer wrong"}), 401, "Unauthorized")
    _err(httpx.post(reranker + "/rerank", json=body, headers={"Authorization": "s3cret-key"}), 401, "Unauthorized")
    assert httpx.post(reranker + "/rerank", json=body, headers=AUTH).status_code == 200
    # probes and scrapes stay public
    assert httpx.get(reranker + "/health").status_code == 200
    assert httpx.get(reranker + "/metrics").status_code == 200
    assert httpx.get(reranker + "/info").status_code == 401


def test_not_ready_503(tmp_path):
    with run_server(wait=False, model_id=str(tmp_path / "missing")) as (url, st):
        deadline = time.time() + 30
        while st.load_error is None and time.time() < deadline:
            time.sleep(0.05)
        _err(httpx.get(url + "/health"), 503, "Unhealthy")
        _err(httpx.post(url + "/embed", json={"inputs": "x"}), 503, "Unhealthy")
        r = httpx.post(url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_truncated_request_line_does_not_hang(minilm_torch):
    host, port = minilm_torch.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{\"inp")
    # the half-sent request is abandoned; the server keeps serving
    assert httpx.post(minilm_torch + "/embed", json={"inputs": "ok"}, timeout=10).status_code == 200


def test_backend_failure_424_and_engine_survives(tmp_path):
    from localcluster.models import minilm_dir

    with run_server(model_id=str(minilm_dir()), backend="torch") as (url, st):
        backend = st.service.backend
        real = backend.forward
        calls = {"n": 0}

        def flaky(batch):  # fault injection: the device fails once
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("CUDA error: device-side assert triggered")
            return real(batch)

        backend.forward = flaky
        msg = _err(httpx.post(url + "/embed", json={"inputs": ["a", "b"]}, timeout=30), 424, "Backend")
        assert "device-side assert" in msg
        assert httpx.post(url + "/embed", json={"inputs": "fine again"}, timeout=30).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        assert st.service.engine.in_flight == 0


def test_bad_requests_do_not_disturb_work_in_flight(minilm_torch, st_model):
    import asyncio

    import numpy as np

    from .conftest import cosine

    good = ["Embeddings map sentences to vectors. " * 30] * 16
    bad = [b'{"inputs": [', b'{"inputs": "\xff"}', b'{"inputs": []}', b'{"inputs": 1}',
           b'{"inputs": "x", "dimensions": -1}', b'[]']

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            g = asyncio.create_task(c.post(minilm_torch + "/embed", json={"inputs": good}))
            bads = await asyncio.gather(*[c.post(minilm_torch + "/embed", content=b,
                                                 headers={"content-type": "application/json"}) for b in bad * 3])
            return await g, bads

    g, bads = asyncio.run(go())
    assert all(400 <= r.status_code < 500 and "error_type" in r.json() for r in bads), [r.status_code for r in bads]
    assert g.status_code == 200
    assert cosine(np.array(g.json()), st_model.encode(good[:1], normalize_embeddings=True)).min() >= 0.9999


def test_lone_surrogate_in_a_rerank_pair_is_422(reranker):
    r = httpx.post(reranker + "/rerank", headers={**AUTH, "content-type": "application/json"},
                   content=b'{"query": "q", "texts": ["fine", "x\\ud800"]}')
    assert r.status_code == 422 and "not valid Unicode" in r.json()["error"], r.text
    ok = httpx.post(reranker + "/rerank", headers=AUTH, json={"query": "q", "texts": ["fine"]})
    assert ok.status_code == 200


def test_cors_preflight_allows_authorization_and_errors_carry_cors_headers(tmp_path):
    from localcluster.models import minilm_dir

    origin = {"Origin": "https://app.example.com"}
    with run_server(model_id=str(minilm_dir()), backend="onnxruntime", api_key="k", onnx_cache=str(tmp_path),
                    cors_allow_origin="https://app.example.com") as (url, st):
        pre = httpx.options(url + "/v1/embeddings", headers={**origin, "Access-Control-Request-Method": "POST",
                                                             "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        denied = httpx.post(url + "/embed", json={"inputs": "x"}, headers=origin)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == origin["Origin"]
        ok = httpx.post(url + "/embed", json={"inputs": "x"}, headers={**origin, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin["Origin"]
        other = httpx.post(url + "/embed", json={"inputs": "x"},
                           headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers
    with run_server(model_id=str(minilm_dir()), backend="onnxruntime", onnx_cache=str(tmp_path)) as (url, st):
        r = httpx.post(url + "/embed", json={"inputs": "x"}, headers=origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # off by default


def test_every_failure_cause_is_exported_at_zero_before_the_first_failure():
    """rate(te_request_failure{err="overloaded"}) and the dashboard's 429 share read 0 on a healthy server, not
    "no data": each cause the router can count exists from the start, and no other value is ever counted."""
    from embedops_server.router import errors
    from embedops_server.router.metrics import FAILURE_CAUSES, Metrics

    text = Metrics().render().decode()
    for err in FAILURE_CAUSES:
        assert f'te_request_failure{{err="{err}"}} 0.0' in text, err
    for method in ("single", "batch"):
        assert f'te_request_count{{method="{method}"}} 0.0' in text
    assert set(errors._FAILURE_LABEL.values()) <= set(FAILURE_CAUSES)
    m = Metrics()
    m.c.inc("te_request_failure", err="overloaded")
    assert 'te_request_failure{err="overloaded"} 1.0' in m.render().decode()
