"""OpenTelemetry traces (issue 54, TEI's --otlp-endpoint): the server exports a span per request and one per stage
to a real OTLP endpoint (the OpenTelemetry protocol's own gRPC service and its HTTP/protobuf route, served here
from the opentelemetry-proto definitions), under the caller's span when the caller sends a W3C traceparent."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from .conftest import free_port, run_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
STAGES = ["parse", "tokenize", "queue", "slot", "forward", "wake", "respond"]


class Received:
    """The spans an OTLP endpoint was sent, flattened with their service name."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def add(self, request) -> None:
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append({
                            "service": service, "name": sp.name, "trace": sp.trace_id.hex(), "id": sp.span_id.hex(),
                            "parent": sp.parent_span_id.hex(), "start": sp.start_time_unix_nano,
                            "end": sp.end_time_unix_nano, "kind": sp.kind,
                            "attributes": {a.key: getattr(a.value, a.value.WhichOneof("value"))
                                           for a in sp.attributes}})

    def wait_for(self, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such span in {[s['name'] for s in self.spans]}")


@pytest.fixture
def grpc_collector():
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the protocol's name
            received.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", received
    server.stop(0)


@pytest.fixture
def http_collector():
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf":
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.add(request)
                self.send_response(200)
            else:
                self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def _model():
    from localcluster.models import minilm_onnx_dir

    return str(minilm_onnx_dir())


def test_a_request_joins_the_callers_trace_with_its_stages(grpc_collector, monkeypatch):
    endpoint, received = grpc_collector
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch processor exports every 0.1 s
    with run_server(model_id=_model(), backend="onnxruntime", pooling="mean", otlp_endpoint=endpoint,
                    otlp_service_name="embeddings-test") as (url, _):
        r = httpx.post(url + "/embed", json={"inputs": ["a traced question", "and another"]}, timeout=60,
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert r.status_code == 200
        server_span = received.wait_for(lambda s: s["trace"] == TRACE_ID and s["parent"] == PARENT_ID)[0]
        assert server_span["name"] == "POST /embed" and server_span["service"] == "embeddings-test"
        assert server_span["kind"] == 2  # SERVER
        a = server_span["attributes"]
        assert a["embedops.inputs"] == 2 and a["embedops.tokens"] > 4 and a["embedops.batch.inputs"] >= 2
        assert a["http.response.status_code"] == 200 and a["http.request.method"] == "POST"
        stages = sorted(received.wait_for(lambda s: s["parent"] == server_span["id"]), key=lambda s: s["start"])
        assert [s["name"] for s in stages] == STAGES, stages
        # consecutive, inside the request's span, as Server-Timing's (which the same answer carries)
        assert stages[0]["start"] == server_span["start"] and stages[-1]["end"] == server_span["end"]
        assert all(x["end"] == y["start"] for x, y in zip(stages, stages[1:]))
        assert all(s["trace"] == TRACE_ID for s in stages)
        total_ms = float(r.headers["server-timing"].split("total;dur=")[1].split(",")[0])
        assert abs((server_span["end"] - server_span["start"]) / 1e6 - total_ms) < 0.01

        # no traceparent: a trace of its own; a refused request: its span and status, no stages
        assert httpx.post(url + "/embed", json={"inputs": []}, timeout=60).status_code in (400, 422)
        refused = received.wait_for(lambda s: s["name"] == "POST /embed" and s["parent"] == "" and
                                    s["attributes"]["http.response.status_code"] in (400, 422))[0]
        assert refused["trace"] != TRACE_ID
        assert httpx.get(url + "/no/such/path", timeout=60).status_code == 404
        assert received.wait_for(lambda s: s["name"] == "GET" and s["attributes"]["url.path"] == "/no/such/path")
        # the probes' and scrapes' routes are not traced (run_server polled /health until the model was loaded)
        assert httpx.get(url + "/metrics", timeout=60).status_code == 200
        assert received.wait_for(lambda s: s["name"] == "POST /embed" and s["trace"] != TRACE_ID)
        assert not [s for s in received.spans if s["attributes"].get("url.path") in ("/health", "/metrics")]


def test_http_protobuf_when_the_protocol_says_so(http_collector, monkeypatch):
    endpoint, received = http_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with run_server(model_id=_model(), backend="onnxruntime", pooling="mean", otlp_endpoint=endpoint) as (url, _):
        assert httpx.post(url + "/v2/embed", json={"texts": ["over HTTP"]}, timeout=60).status_code == 200
        span = received.wait_for(lambda s: s["name"] == "POST /v2/embed")[0]
        assert span["service"] == "text-embeddings-inference.server"  # TEI's default name
        assert len(received.wait_for(lambda s: s["parent"] == span["id"])) == len(STAGES)
