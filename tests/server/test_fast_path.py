"""The embedding routes' fast path answers exactly what FastAPI answers: the same status, body and headers for
valid and invalid requests alike, checked against a server with EMBEDOPS_FAST_PATH=0."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from embedops_server.router import fast_path
from localcluster.models import minilm_onnx_dir

from .conftest import run_server

CASES = [
    # (path, body bytes, content type or None, served by the fast path?)
    ("/embed", b'{"inputs": "what is an embedding?"}', "application/json", True),
    ("/embed", b'{"inputs": ["one", "two words"], "normalize": false, "dimensions": 8}', "application/json", True),
    ("/embed", b'{"inputs": [[101, 2054, 102]], "truncate": true}', "application/vnd.api+json", True),
    ("/embed", b'{"inputs": "x"}', None, False),  # no content type: FastAPI's 422
    ("/embed", b'{"inputs": "x", "extra": 1}', "application/json; charset=utf-8", True),
    ("/embed", b'{"inputs": ""}', "application/json", True),  # 400 Empty, raised in the route
    ("/embed", b'{"inputs": "x", "dimensions": 100000}', "application/json", True),  # 422 from the route
    ("/embed", b'{"inputs": "x", "prompt_name": "nope"}', "application/json", True),  # 422 from the route
    ("/embed", b'{"inputs": 5}', "application/json", False),  # pydantic refuses: FastAPI's 422
    ("/embed", b'{"inputs": "x", "normalize": "yes"}', "application/json", False),
    ("/embed", b'{"inputs": "x"', "application/json", False),  # malformed JSON
    ("/embed", b'\xff\xfe', "application/json", False),  # not UTF-8
    ("/embed", b'{"inputs": "x"}', "text/plain", False),  # FastAPI does not read it as JSON: its 422
    ("/v1/embeddings", b'{"input": "hello", "model": "m"}', "application/json", True),
    ("/v1/embeddings", b'{"input": ["a", "b"], "model": "m", "encoding_format": "base64"}', "application/json", True),
    ("/v1/embeddings", b'{"input": []}', "application/json", True),  # OpenAI's error shape
    ("/v1/embeddings", b'{"input": {"a": 1}}', "application/json", False),
    ("/embeddings", b'{"input": "hello"}', "application/json", True),
]
SAME_HEADERS = ("content-type", "content-length", "retry-after", "x-compute-tokens", "x-compute-type", "allow")


@pytest.fixture(scope="module")
def servers(monkeypatch_module):
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean") as (fast, _):
        monkeypatch_module.setenv("EMBEDOPS_FAST_PATH", "0")
        with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean") as (plain, _):
            yield fast, plain


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _same(a: httpx.Response, b: httpx.Response) -> None:
    assert a.status_code == b.status_code, (a.text, b.text)
    for h in SAME_HEADERS:
        assert a.headers.get(h) == b.headers.get(h), h
    if a.status_code != 200:
        assert a.content == b.content
        return
    ja, jb = a.json(), b.json()
    if isinstance(ja, dict):  # OpenAI: the same document; base64 strings of float32 compared as vectors
        da, db = ja.pop("data"), jb.pop("data")
        assert ja == jb and len(da) == len(db)
        for x, y in zip(da, db):
            ex, ey = x.pop("embedding"), y.pop("embedding")
            assert x == y
            if isinstance(ex, str):
                import base64
                ex, ey = (np.frombuffer(base64.b64decode(e), "<f4") for e in (ex, ey))
            assert np.allclose(ex, ey, atol=1e-5)
    else:
        assert np.allclose(np.array(ja), np.array(jb), atol=1e-5)


@pytest.mark.parametrize("path,body,ctype,fast", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_same_answer_as_fastapi(servers, monkeypatch, path, body, ctype, fast):
    fast_url, plain_url = servers
    calls = []
    for route, (handler, model) in list(fast_path.ROUTES.items()):
        async def spy(request, parsed, _handler=handler):
            calls.append(request.url.path)
            return await _handler(request, parsed)
        monkeypatch.setitem(fast_path.ROUTES, route, (spy, model))
    headers = {"content-type": ctype} if ctype else {}
    a = httpx.post(fast_url + path, content=body, headers=headers, timeout=30)
    b = httpx.post(plain_url + path, content=body, headers=headers, timeout=30)
    _same(a, b)
    assert calls == ([path] if fast else [])
    if fast:
        assert "server-timing" in a.headers or a.status_code != 200


def test_a_chunked_body_and_the_api_key_go_through_the_guard_first(monkeypatch):
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean",
                    api_key="k", payload_limit=200) as (url, _):
        assert httpx.post(url + "/embed", json={"inputs": "x"}).status_code == 401
        auth = {"authorization": "Bearer k", "content-type": "application/json"}
        chunks = iter([b'{"inputs": ', b'"a chunked query"}'])
        r = httpx.post(url + "/embed", content=chunks, headers=auth)
        assert r.status_code == 200 and len(r.json()[0]) == 384
        big = iter([b'{"inputs": "', b"x" * 300, b'"}'])
        r = httpx.post(url + "/embed", content=big, headers=auth)
        assert r.status_code == 413 and r.json()["error_type"] == "PayloadTooLarge"
