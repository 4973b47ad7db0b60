"""A TEI command line starts embedops-server (issue 54): every flag of TEI 1.9.3's `text-embeddings-router` (its
`router/src/main.rs`, clap `#[clap(long, env)]`: each flag has an UPPER_SNAKE variable) is accepted, as a flag and as
its variable, and those that mean something here do it (tested where they act: --dense-path in test_dense.py,
--prometheus-port below, --otlp-endpoint in test_tracing.py). TEI flags accepted without effect are listed with the
reason."""
from __future__ import annotations

import socket

import httpx
import pytest

from embedops_server.cli import parse_args
from embedops_server.settings import Settings

# TEI 1.9.3's flags, a value each (`-p` is --port's short form)
TEI_FLAGS = {
    "model-id": "BAAI/bge-small-en-v1.5", "revision": "main", "tokenization-workers": "2", "dtype": "float32",
    "served-model-name": "bge", "pooling": "mean", "max-concurrent-requests": "512", "max-batch-tokens": "16384",
    "max-batch-requests": "8", "max-client-batch-size": "32", "auto-truncate": "true",
    "default-prompt-name": "query", "default-prompt": "query: ", "dense-path": "2_Dense", "hf-token": "hf_x",
    "hf-api-token": "hf_y", "hostname": "0.0.0.0", "port": "3000", "uds-path": "/tmp/tei-server",
    "huggingface-hub-cache": "/data", "payload-limit": "2000000", "api-key": "k", "json-output": "true",
    "disable-spans": "true", "otlp-endpoint": "http://otel:4317", "otlp-service-name": "tei",
    "prometheus-port": "9000", "cors-allow-origin": "*",
}
MUTUALLY_EXCLUSIVE = {"default-prompt-name", "default-prompt"}  # TEI refuses both together too
# accepted, and why they change nothing here
WITHOUT_EFFECT = {
    "uds-path": "TEI's socket to its Python backend process; embedops runs the model in the server's process",
    "disable-spans": "TEI's span fields in JSON logs; embedops' JSON logs have none",
}


@pytest.mark.parametrize("flag", sorted(TEI_FLAGS))
def test_every_tei_flag_is_accepted_as_a_flag_and_as_its_variable(flag):
    value = TEI_FLAGS[flag]
    argv = ["--model-id", "x", f"--{flag}", value] if flag != "model-id" else [f"--{flag}", value]
    field = flag.replace("-", "_")
    s = parse_args(argv, environ={})
    by_env = Settings.from_environment({"MODEL_ID": "x", Settings.env_name(field): value})
    for got in (s, by_env):
        have = getattr(got, field)
        assert str(have).lower() == value.lower() or have == type(have)(value), (flag, have)


def test_the_list_is_tei_1_9_3s_and_the_defaults_that_differ_are_said():
    assert len(TEI_FLAGS) == 28 and set(WITHOUT_EFFECT) <= set(TEI_FLAGS)
    s = parse_args(["--model-id", "x"], environ={})
    # where embedops' default is not TEI's, on purpose (README "Server flags")
    assert s.port == 8080  # TEI 3000 (its images set PORT=80)
    assert s.prometheus_port is None  # TEI 9000, which its HTTP build ignores: /metrics on --port, as there
    assert s.cors_allow_origin is None  # TEI: any origin


def test_a_kubernetes_service_link_is_not_a_metrics_port():
    """A Service named prometheus puts PROMETHEUS_PORT=tcp://<ip>:9090 into every pod of its namespace (service
    links): only a number counts, as only an address counts for HOSTNAME."""
    s = Settings.from_environment({"MODEL_ID": "x", "PROMETHEUS_PORT": "tcp://10.96.0.12:9090"})
    assert s.prometheus_port is None
    assert Settings.from_environment({"MODEL_ID": "x", "PROMETHEUS_PORT": "9000"}).prometheus_port == 9000
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "x", "--prometheus-port", "8080"], environ={})  # the API's own port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_port_serves_the_metrics_there_and_only_there():
    from localcluster.models import minilm_onnx_dir

    from .conftest import run_server

    metrics_port = _free_port()
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", prometheus_port=metrics_port) as (url, st):
        assert httpx.post(url + "/embed", json={"inputs": "counted"}).status_code == 200
        m = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert m.status_code == 200 and "te_request_count" in m.text
        api = httpx.get(url + "/metrics")
        assert api.status_code == 404 and f"served on port {metrics_port}" in api.json()["error"]
        other = httpx.post(f"http://127.0.0.1:{metrics_port}/embed", json={"inputs": "x"})
        assert other.status_code == 404 and "only /metrics" in other.json()["error"]
        assert httpx.get(url + "/health").status_code == 200
