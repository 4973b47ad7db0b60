"""TEI as a bench peer (bench/tei.py): target names, model folders, the skip line, argv, ratios. Never builds
or starts TEI."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench import report, tei


def test_parse_names():
    s = tei.parse_tei("tei")
    assert (s.backend, s.quantize, s.flags) == ("ort", None, [])
    assert tei.parse_tei("tei+int8").quantize == "int8"
    assert tei.parse_tei("tei+quantize=int8").quantize == "int8"
    s = tei.parse_tei("tei-candle+max-batch-requests=2+auto-truncate")
    assert s.backend == "candle" and s.flags == ["--max-batch-requests", "2", "--auto-truncate"]
    assert tei.parse_tei("tei+fused").fused and not tei.parse_tei("tei").fused
    s = tei.parse_tei("tei+int8+fused")
    assert s.fused and s.quantize == "int8"
    for bad in ("tei-candle+int8", "tei+quantize=int4", "teix", "embedops-onnx", "tei++x", "tei-candle+fused"):
        with pytest.raises(ValueError):
            tei.parse_tei(bad)
    assert tei.is_tei("tei+int8") and tei.is_tei("tei-candle") and not tei.is_tei("embedops-onnx")


def test_like_for_like_peer():
    assert tei.peer_for("embedops-onnx") == "tei"
    assert tei.peer_for("embedops-onnx+quantize=int8") == "tei+int8"
    assert tei.peer_for("embedops-onnx+quantize=int8/rerank") == "tei+int8"
    assert tei.peer_for("embedops-torch") == "tei"


def _model(tmp_path: Path) -> Path:
    m = tmp_path / "model"
    (m / "1_Pooling").mkdir(parents=True)
    (m / "onnx").mkdir()
    for f in ("config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        (m / f).write_text("{}")
    (m / "model.safetensors").write_bytes(b"w")
    (m / "onnx" / "model.onnx").write_bytes(b"theirs")
    return m


def _graph(path: Path, external: bool = False) -> Path:
    """A one-initializer ONNX graph at ``path``, its weight in ``<name>_data`` beside it when ``external``."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [], [out],
                                                initializer=[w]))
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + "_data",
                        size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    return path


def test_ort_folder_links_configs_and_our_graph_but_no_weights(tmp_path):
    m = _model(tmp_path)
    graph = _graph(tmp_path / "cache" / "model.eager.onnx")
    out = tei.ort_folder(m, graph, root=tmp_path / "tei-models")
    assert (out / "onnx" / "model.onnx").read_bytes() == graph.read_bytes()
    assert (out / "1_Pooling" / "config.json").is_symlink() and (out / "config.json").exists()
    assert not (out / "model.safetensors").exists()  # so TEI cannot fall back to candle silently
    assert not (out / "model.onnx").exists()
    assert tei.ort_folder(m, graph, root=tmp_path / "tei-models") == out  # rebuilt in place
    other = _graph(tmp_path / "cache" / "model.eager.int8.onnx")
    assert tei.ort_folder(m, other, root=tmp_path / "tei-models") != out
    assert len(list((tmp_path / "tei-models").iterdir())) == 2


def test_ort_folder_links_a_graphs_external_data_beside_it(tmp_path):
    """bge-m3's onnx/model.onnx keeps its weights in model.onnx_data: ONNX Runtime looks beside the path TEI
    gives it, so the data file must be linked there under the name the graph records."""
    graph = _graph(tmp_path / "m3" / "onnx" / "model.onnx", external=True)
    out = tei.ort_folder(_model(tmp_path), graph, root=tmp_path / "tei-models")
    assert (out / "onnx" / "model.onnx_data").resolve() == (graph.parent / "model.onnx_data").resolve()
    import onnxruntime

    assert onnxruntime.InferenceSession(str(out / "onnx" / "model.onnx")).run(None, {})[0].tolist() == [1.0] * 4


def test_absent_build_is_one_line_and_target_refuses(tmp_path):
    why = tei.unavailable_reason(tmp_path)
    assert why and "\n" not in why and "python -m bench.tei build" in why
    with pytest.raises(tei.TeiUnavailable):
        tei.tei_target("tei-candle", tmp_path, log_dir=tmp_path, home=tmp_path)


def _fake_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "text-embeddings-router").write_text("")
    (home / "run-tei").write_text("#!/bin/sh\n")
    os.chmod(home / "run-tei", 0o755)
    return home


def test_argv_has_distinct_ports(tmp_path, monkeypatch):
    home = _fake_home(tmp_path)
    assert tei.unavailable_reason(home) is None
    m = _model(tmp_path)
    t = tei.tei_target("tei-candle+max-batch-requests=2", m, log_dir=tmp_path, home=home)
    a = t.server.argv
    val = lambda flag: a[a.index(flag) + 1]
    assert a[0] == str(home / "run-tei") and val("--model-id") == str(m)
    assert int(val("--port")) == t.server.port and int(val("--prometheus-port")) == t.server.prometheus_port
    assert t.server.port != t.server.prometheus_port
    assert val("--max-client-batch-size") == "64" and val("--max-batch-requests") == "2"
    assert t.embed_path == "/embed" and t.rerank_path is None
    assert t.embed_body(["a"]) == {"inputs": "a"}

    seen = []
    graph = _graph(tmp_path / "g.onnx")
    monkeypatch.setattr(tei, "onnx_for", lambda d, q, fused=False: seen.append((q, fused)) or graph)
    monkeypatch.setattr(tei, "CACHE", tmp_path)
    t = tei.tei_target("tei+int8", m, rerank_model=m, log_dir=tmp_path, home=home)
    folder = Path(t.server.argv[t.server.argv.index("--model-id") + 1])
    assert seen == [("int8", False)] and (folder / "onnx" / "model.onnx").is_symlink()
    assert t.rerank_path == "/rerank" and t.rerank_body("q", ["a", "b"]) == {"query": "q", "texts": ["a", "b"]}


def test_metrics_fall_back_to_the_prometheus_port(tmp_path):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"te_batch_next_size_count 3\n" if self.path == "/metrics" else b"no"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        s = tei.TeiServer("tei", ["x"], 1, prometheus_port=srv.server_address[1])
        assert s.get("/metrics").startswith("te_batch_next_size_count")
        assert s.get("/info") is None  # port 1: nothing there, and only /metrics falls back
    finally:
        srv.shutdown()


def test_ratio_lines():
    rows = [
        {"scenario": "1-online", "target": "embedops-onnx", "kind": "http", "ok": 9, "p50_ms": 5.0, "p99_ms": 8.0},
        {"scenario": "1-online", "target": "tei", "kind": "http", "ok": 9, "p50_ms": 4.0, "p99_ms": 6.0},
        {"scenario": "1-online", "target": "tei-candle", "kind": "http", "ok": 9, "p50_ms": 10.0, "p99_ms": 12.0},
        {"scenario": "2-c16", "target": "embedops-onnx+quantize=int8", "kind": "http", "ok": 9, "texts_s": 400.0,
         "p99_ms": 50.0, "server_cpu_ms": 1.5, "client_cpu_ms": 0.4},
        {"scenario": "2-c16", "target": "tei+int8", "kind": "http", "ok": 9, "texts_s": 200.0, "p99_ms": 100.0,
         "server_cpu_ms": 2.0, "client_cpu_ms": 0.4},
        {"scenario": "4-rerank", "target": "embedops-onnx", "kind": "http", "ok": 1, "p50_ms": 100.0},
        {"scenario": "4-rerank", "target": "tei+int8", "kind": "http", "na": "x"},
    ]
    lines = report.tei_ratio_lines({"rows": rows})
    one = next(x for x in lines if x.startswith("1-online"))
    assert one.split()[-5:] == ["0.80", "0.75", "2.00", "-", "-"]  # no CPU figures measured: dashes
    two = next(x for x in lines if x.startswith("2-c16"))
    assert two.split()[-5:] == ["2.00", "2.00", "-", "1.50", "2.00"]  # and the CPU per request of each
    assert not any(x.startswith("4-rerank") for x in lines)
    assert report.tei_ratio_lines({"rows": rows[:1]}) == []
    table = report.table({"rows": rows, "meta": {}})
    assert "embedops vs TEI" in table and "cpu/req server 1.50 client 0.40 ms" in table
    assert json.dumps(lines)


def test_na_reason():
    assert "int8" in tei.na_reason("tei+int8", "4-rerank")


def test_runner_skips_an_absent_tei_in_one_line(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from bench.cli import ALL_TARGETS, Runner

    monkeypatch.setenv("EMBEDOPS_TEI_HOME", str(tmp_path / "none"))
    r = Runner.__new__(Runner)
    r.errors, r.targets, r.meta, r.logs, r.model_dir, r.rerank_dir = {}, {}, {}, tmp_path, tmp_path, None
    r.args = SimpleNamespace(onnx_backend_name="onnx", embedops_args=[])
    r.start_targets(["tei", "tei-candle"], rerank=False)
    assert not r.targets and set(r.errors) == {"tei", "tei-candle"}
    assert all(v.startswith("TeiUnavailable: ") and "\n" not in v for v in r.errors.values())
    assert {"tei", "tei+int8", "tei-candle"} <= set(ALL_TARGETS)
