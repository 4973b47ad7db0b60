"""Every remaining TEI route, the OpenAPI document, docs, metrics and response headers."""
from __future__ import annotations

import base64
import functools
import json
import time

import httpx
import numpy as np
import torch

from localcluster.models import minilm_dir

from .conftest import STATES, TEXTS, cosine


def test_embed_options(minilm_torch, st_model):
    u = minilm_torch
    ref = st_model.encode(TEXTS[:3], normalize_embeddings=False)
    raw = np.array(httpx.post(u + "/embed", json={"inputs": TEXTS[:3], "normalize": False}).json())
    assert cosine(raw, ref).min() >= 0.9999
    assert (np.linalg.norm(raw, axis=1) > 1.5).all()  # the pooled vector, not unit length
    # MRL: truncate then renormalize
    r = np.array(httpx.post(u + "/embed", json={"inputs": TEXTS[:3], "dimensions": 64}).json())
    assert r.shape == (3, 64)
    exp = ref[:, :64] / np.linalg.norm(ref[:, :64], axis=1, keepdims=True)
    assert cosine(r, exp).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(r, axis=1), 1, rtol=1e-5)
    # token ids are decoded and re-tokenized, like TEI
    tok_ids = st_model.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    by_ids = httpx.post(u + "/embed", json={"inputs": tok_ids}).json()
    assert cosine(by_ids[0], st_model.encode("hello world")) >= 0.9999
    # truncation direction: left keeps the end of the text
    long = "alpha " * 300 + "quantum chromodynamics explains how quarks and gluons interact " * 10
    right = httpx.post(u + "/embed", json={"inputs": long, "truncate": True}).json()[0]
    left = httpx.post(u + "/embed", json={"inputs": long, "truncate": True, "truncation_direction": "Left"}).json()[0]
    assert cosine(right, left) < 0.9
    assert cosine(right, st_model.encode(long)) >= 0.9999  # ST truncates right at 256 tokens


def test_embed_all_matches_hidden_states(minilm_torch):
    from transformers import AutoModel, AutoTokenizer

    r = httpx.post(minilm_torch + "/embed_all", json={"inputs": ["Hello world", "a longer second sentence here"]})
    assert r.status_code == 200, r.text
    got = r.json()
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = AutoModel.from_pretrained(str(minilm_dir())).eval()
    for text, tokens in zip(["Hello world", "a longer second sentence here"], got):
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].numpy()
        assert np.array(tokens).shape == h.shape
        np.testing.assert_allclose(np.array(tokens), h, atol=2e-4)


def test_similarity(minilm_torch, st_model):
    src, sents = "A man is eating food.", ["A man eats a meal.", "A plane is taking off.", "Someone is eating."]
    r = httpx.post(minilm_torch + "/similarity", json={"inputs": {"source_sentence": src, "sentences": sents}})
    assert r.status_code == 200, r.text
    ref = st_model.encode([src, *sents], normalize_embeddings=True)
    np.testing.assert_allclose(r.json(), ref[1:] @ ref[0], atol=1e-4)


def test_tokenize_and_decode(minilm_torch):
    r = httpx.post(minilm_torch + "/tokenize", json={"inputs": ["Hello world", "Paris"]})
    assert r.status_code == 200, r.text
    toks = r.json()
    assert [t["text"] for t in toks[0]] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert toks[0][0]["special"] and not toks[0][1]["special"]
    assert (toks[0][2]["start"], toks[0][2]["stop"]) == (6, 11)
    ids = [t["id"] for t in toks[0]]
    assert ids[0] == 101 and ids[-1] == 102
    no_special = httpx.post(minilm_torch + "/tokenize", json={"inputs": "Hello", "add_special_tokens": False}).json()
    assert len(no_special[0]) == 1
    d = httpx.post(minilm_torch + "/decode", json={"ids": ids})
    assert d.status_code == 200 and d.json() == ["hello world"]
    d = httpx.post(minilm_torch + "/decode", json={"ids": [ids, ids], "skip_special_tokens": False}).json()
    assert d == ["[CLS] hello world [SEP]"] * 2


def test_headers_info_health(minilm_torch):
    r = httpx.post(minilm_torch + "/embed", json={"inputs": ["Hello world", "x"]})
    for h in ("x-compute-time", "x-queue-time", "x-inference-time", "x-tokenization-time", "x-total-time"):
        assert float(r.headers[h]) >= 0
    assert int(r.headers["x-compute-tokens"]) == 4 + 3
    assert httpx.get(minilm_torch + "/health").status_code == 200
    info = httpx.get(minilm_torch + "/info").json()
    assert info["max_batch_tokens"] == 16384 and info["max_input_length"] == 256
    assert info["max_concurrent_requests"] == 512 and info["model_type"]["embedding"]["pooling"] == "mean"


def test_server_timing_breaks_the_request_down(minilm_torch):
    """Every answered inference request says where its time went (Server-Timing): the stages in order, none
    negative, adding up to `total`, which does not exceed what the client measured; the batch it rode in."""
    import time

    from bench.loadgen import parse_server_timing  # what the bench reads, so the two cannot disagree

    for route, body in (("/embed", {"inputs": ["Hello world", "x"]}),
                        ("/v1/embeddings", {"input": ["Hello world", "x"], "model": "m"})):
        t = time.perf_counter()
        r = httpx.post(minilm_torch + route, json=body)
        client_ms = (time.perf_counter() - t) * 1000
        assert r.status_code == 200
        timing = {k[3:]: v for k, v in parse_server_timing(r.headers["server-timing"]).items()}
        stages = ["parse", "tokenize", "queue", "slot", "forward", "wake", "respond"]
        assert list(timing)[:len(stages) + 1] == stages + ["total"], timing
        durs = {k: timing[k] for k in stages + ["total"]}
        assert all(v >= 0 for v in durs.values()), durs
        assert durs["forward"] > 0
        assert abs(sum(durs[k] for k in stages) - durs["total"]) < 0.01 * len(stages), durs
        assert durs["total"] <= client_ms
        assert timing["batch"] == 2  # alone on the server: both inputs in one forward
    # not for an answer the engine never saw, nor for the probes
    bad = httpx.post(minilm_torch + "/embed", json={"inputs": []})
    assert bad.status_code == 400 and "server-timing" not in bad.headers  # TEI: empty input is a 400
    assert "server-timing" not in httpx.get(minilm_torch + "/health").headers


def test_openapi_docs_metrics(minilm_torch):
    spec = httpx.get(minilm_torch + "/openapi.json").json()
    for path in ("/embed", "/embed_all", "/similarity", "/tokenize", "/decode", "/v1/embeddings", "/info", "/health",
                 "/metrics"):
        assert path in spec["paths"], path
    for path in ("/embed_sparse", "/rerank", "/predict", "/v1/rerank"):  # the loaded model's routes only
        assert path not in spec["paths"], path
    docs = httpx.get(minilm_torch + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    httpx.post(minilm_torch + "/embed", json={"inputs": "warm"})
    text = httpx.get(minilm_torch + "/metrics").text
    for name in ("te_request_count", "te_request_success", "te_request_failure", "te_embed_count",
                 "te_request_duration", "te_request_queue_duration", "te_request_inference_duration",
                 "te_request_tokenization_duration", "te_request_input_length", "te_batch_next_size",
                 "te_batch_next_tokens", "te_queue_size"):
        assert f"# HELP {name} " in text, name
    assert 'te_request_success{method="single"}' in text
    assert "_total" not in text and "_created" not in text


def test_openai_sdk_float_and_base64(minilm_torch, st_model):
    from openai import OpenAI

    client = OpenAI(base_url=minilm_torch + "/v1", api_key="unused", max_retries=0)
    f = client.embeddings.create(model="minilm", input=TEXTS[:3], encoding_format="float")
    b = client.embeddings.create(model="minilm", input=TEXTS[:3], encoding_format="base64")
    vf = np.array([d.embedding for d in f.data])
    # an explicit base64 request hands back the string: little-endian float32 bytes
    vb = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if isinstance(d.embedding, str)
                   else d.embedding for d in b.data])
    np.testing.assert_array_equal(vf.astype(np.float32), vb.astype(np.float32))
    assert cosine(vf, st_model.encode(TEXTS[:3])).min() >= 0.9999
    assert f.usage.prompt_tokens > 0 and f.model
    # the SDK's default (no encoding_format) asks for base64 and decodes it
    d = client.embeddings.create(model="minilm", input="Hello world", dimensions=32)
    assert len(d.data[0].embedding) == 32
    models = [m.id for m in client.models.list()]
    assert models == [f.model] and client.models.retrieve(f.model).id == f.model
    raw = httpx.post(minilm_torch + "/v1/embeddings", json={"input": "Hello world", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and cosine(vec, st_model.encode("Hello world")) >= 0.9999


def test_root_and_invocations_route_by_task(minilm_torch, st_model):
    for path in ("/", "/invocations"):
        r = httpx.post(minilm_torch + path, json={"inputs": ["Hello world"]})
        assert r.status_code == 200, r.text
        assert cosine(r.json()[0], st_model.encode("Hello world")) >= 0.9999
    r = httpx.post(minilm_torch + "/", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation"
    assert httpx.get(minilm_torch + "/").status_code == 200


def test_shape_buckets_do_not_change_results(minilm_torch, st_model):
    """The GPU path pads batches to bucket shapes (for CUDA graphs); padded rows/columns must not leak."""
    from embedops_server.backends.torch_backend import TorchBackend

    backend = STATES[minilm_torch].service.backend
    backend.bucket = lambda rows, cols: TorchBackend.bucket(_Gpu(), rows, cols)
    try:
        assert backend.bucket(3, 17) == (4, 32)
        got = np.array(httpx.post(minilm_torch + "/embed", json={"inputs": TEXTS[:3]}).json())
    finally:
        del backend.bucket
    assert cosine(got, st_model.encode(TEXTS[:3], normalize_embeddings=True)).min() >= 0.9999


class _Gpu:
    device = "cuda"


def test_openai_models_list(minilm_torch):
    """OpenAI SDKs (client.models.list()), LiteLLM and UIs discover the served model here."""
    listed = httpx.get(minilm_torch + "/v1/models").json()
    assert listed["object"] == "list" and len(listed["data"]) == 1
    card = listed["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "embedops" and card["created"] > 1.7e9
    assert httpx.get(minilm_torch + "/v1/models/" + card["id"]).json() == card  # ids may contain "/"
    r = httpx.get(minilm_torch + "/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert "no-such-model" in r.json()["error"]["message"]


def _counter(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and (not want or want in line) or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_request_count_counts_failed_requests_too(minilm_torch):
    """TEI counts every request in te_request_count, so failure / count is a failure ratio: a refused request
    must raise te_request_count as much as te_request_failure."""
    u = minilm_torch
    before = httpx.get(u + "/metrics").text
    assert httpx.post(u + "/embed", json={"inputs": ""}).status_code == 400  # empty: validation
    assert httpx.post(u + "/embed", json={"inputs": ["a"] * 1000}).status_code == 422  # over the batch size
    assert httpx.post(u + "/embed", json={"inputs": ["a", "b"]}).status_code == 200
    after = httpx.get(u + "/metrics").text
    count = _counter(after, "te_request_count") - _counter(before, "te_request_count")
    failed = _counter(after, "te_request_failure") - _counter(before, "te_request_failure")
    ok = _counter(after, "te_request_success") - _counter(before, "te_request_success")
    assert (count, failed, ok) == (3, 2, 1)


def test_embed_all_refuses_an_answer_over_its_token_limit_and_holds_few_answers_at_once():
    """Issue 53: /embed_all answers tokens x width floats; a request of many long inputs made a replica hold that
    (a 32 x 8192-token bge-m3 request: ~1 GiB of float32 before JSON). Over --max-embed-all-tokens: 422 at once.
    And answers of every token's state in progress at once, from admission until sent, are at most
    --max-token-answers (the memory estimate counts them): one more is 429, even while the one in progress waits
    on a client that does not read it; its slot is free again once that client is gone."""
    import socket

    from localcluster.models import minilm_onnx_dir

    from .conftest import run_server

    long = "a longer text that goes on " * 40  # truncated at MiniLM's 256 tokens
    # not httpx's default 5 s: 17 x 256 tokens on a CI machine's busy cores once took longer (a cold CI, 2026-12-07)
    post = functools.partial(httpx.post, timeout=60)
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", max_embed_all_tokens=4096,
                    max_token_answers=1) as (url, st):
        ok = post(url + "/embed_all", json={"inputs": ["a short one"]})
        assert ok.status_code == 200 and len(ok.json()[0]) < 40
        r = post(url + "/embed_all", json={"inputs": [long] * 17})
        assert r.status_code == 422 and "over the limit of 4096 tokens (--max-embed-all-tokens)" in r.json()["error"]
        assert post(url + "/embed", json={"inputs": [long] * 17}).status_code == 200
        # 16 x 256 tokens x 384 floats: ~15 MB of JSON to a client that never reads it
        body = json.dumps({"inputs": [long] * 16}).encode()
        host, port = url.removeprefix("http://").split(":")
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect((host, int(port)))
        slow.sendall(b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while st.svc().lanes.token_answers == 0:  # admitted; then its answer waits on the client
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
        busy = post(url + "/embed_all", json={"inputs": ["a short one"]})
        assert busy.status_code == 429 and "answers of every token's state in progress" in busy.json()["error"], \
            busy.text
        assert busy.headers["retry-after"] == "1"
        assert post(url + "/embed", json={"inputs": ["others are served"]}).status_code == 200
        slow.close()  # the client goes away: the slot is free again
        deadline = time.monotonic() + 30
        while (r := post(url + "/embed_all", json={"inputs": ["a short one"]})).status_code != 200:
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert st.svc().lanes.token_answers == 0
