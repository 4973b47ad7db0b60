"""A failing cluster test says in one line when the real node is under DiskPressure (issue 40, point 4): the
kubelet then evicts pods and deletes unused images, and the test itself fails minutes later with a message
about something else. Read from a Node as the API server serves it (a local HTTP server stands in for it)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests import conftest


def _node(pressure: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-real-0"},
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-05T08:00:00Z"},
                {"type": "DiskPressure", "status": pressure, "lastTransitionTime": "2026-12-05T09:14:07Z"}]}}


class _FakeKube:
    real_node = "cpu-real-0"

    def __init__(self, url: str):
        self.url = url

    def api_client(self):
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)


@pytest.mark.parametrize("pressure", ["True", "False"])
def test_disk_pressure_is_named_in_one_line_only_when_the_node_reports_it(monkeypatch, pressure):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(_node(pressure)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(conftest, "SESSION_KUBE", _FakeKube(f"http://127.0.0.1:{server.server_port}"))
        line = conftest.disk_pressure_line()
    finally:
        server.shutdown()
        server.server_close()
    if pressure == "True":
        assert line and "\n" not in line, line
        assert "cpu-real-0 is under DiskPressure since 2026-12-05 09:14:07" in line and "GiB free" in line, line
    else:
        assert line is None


def test_no_cluster_no_line(monkeypatch):
    monkeypatch.setattr(conftest, "SESSION_KUBE", None)
    assert conftest.disk_pressure_line() is None
