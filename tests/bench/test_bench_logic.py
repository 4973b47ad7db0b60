"""Fast tests of the benchmark's own logic: load generator (against a tiny in-process server), statistics,
text generation, ratios and the report. No timing assertions."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import report
from bench.loadgen import Request, Sample, check_loopback, percentile, run_load, summarize
from bench.soak import slope_mb_per_min


def test_percentile_interpolates():
    assert percentile([], 50) != percentile([], 50)  # nan
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3


def test_summarize_counts_only_successes_in_latency_and_throughput():
    s = [Sample(0.0, 0.1, True, 200, 2, 20), Sample(0.5, 0.5, True, 200, 2, 20),
         Sample(0.2, 0.01, False, 429, 2, 20, "http:429")]
    st = summarize(s)
    assert st.requests == 3 and st.ok == 2 and st.errors == 1
    assert st.error_kinds == {"429": 1}
    assert st.wall_s == pytest.approx(1.0)
    assert st.req_s == pytest.approx(2.0) and st.texts_s == pytest.approx(4.0) and st.tokens_s == pytest.approx(40.0)
    assert st.p50_ms == pytest.approx(300.0)


def test_loadgen_refuses_non_loopback():
    with pytest.raises(ValueError):
        check_loopback("http://example.com/embed")
    check_loopback("http://127.0.0.1:1/embed")


class _Handler(BaseHTTPRequestHandler):
    calls = 0
    lock = threading.Lock()

    def do_POST(self):
        n = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(n))
        with _Handler.lock:
            _Handler.calls += 1
        if body.get("fail"):
            self.send_response(503)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        out = json.dumps([[0.0] * 3 for _ in body["inputs"]]).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture()
def fake_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    _Handler.calls = 0
    yield f"http://127.0.0.1:{srv.server_address[1]}/embed"
    srv.shutdown()


def test_closed_loop_is_bounded_by_count_and_records_errors(fake_server):
    reqs = [Request({"inputs": ["a", "b"]}, 2, 10), Request({"inputs": ["c"], "fail": True}, 1, 5)]
    samples, wall = asyncio.run(run_load(fake_server, reqs, concurrency=4, max_requests=20, duration_s=30,
                                         warmup=2, check=lambda r: isinstance(r, list)))
    assert len(samples) == 20  # warm-up not recorded
    assert _Handler.calls == 22
    st = summarize(samples, wall)
    assert st.ok == 10 and st.errors == 10 and st.error_kinds == {"503": 10}
    assert st.texts_s > 0 and wall > 0


def test_closed_loop_is_bounded_by_time(fake_server):
    samples, wall = asyncio.run(run_load(fake_server, [Request({"inputs": ["x"]})], concurrency=2,
                                         max_requests=10**9, duration_s=0.3))
    assert samples and wall < 5


def test_open_loop_poisson_arrivals(fake_server):
    samples, wall = asyncio.run(run_load(fake_server, [Request({"inputs": ["x"]})], concurrency=4, rate=200,
                                         max_requests=30, duration_s=5, seed=1))
    assert len(samples) == 30 and all(s.ok for s in samples)


def test_check_rejects_bad_bodies(fake_server, monkeypatch):
    import bench.loadgen as lg

    monkeypatch.setattr(lg, "CHECK_EVERY", 1)
    samples, _ = asyncio.run(run_load(fake_server, [Request({"inputs": ["x"]})], concurrency=1, max_requests=3,
                                      duration_s=5, check=lambda r: False))
    assert all(not s.ok and s.error.startswith("check") for s in samples)


def test_unreachable_server_is_an_error_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    samples, _ = asyncio.run(run_load(f"http://127.0.0.1:{port}/embed", [Request({"inputs": ["x"]})],
                                      concurrency=2, max_requests=4, duration_s=5))
    assert len(samples) == 4 and not any(s.ok for s in samples)


def test_textgen_exact_token_counts():
    tokenizers = pytest.importorskip("tokenizers")
    from bench.models import minilm_dir
    from bench.textgen import TextGen, load_tokenizer

    try:
        tok = load_tokenizer(minilm_dir())
    except Exception as e:  # model package missing
        pytest.skip(str(e))
    g1, g2 = TextGen(tok, seed=7), TextGen(tok, seed=7)
    a = g1.texts(20, (16, 512))
    assert a == g2.texts(20, (16, 512))  # deterministic
    counts = g1.count(a)
    assert all(16 <= n <= 512 for n in counts)
    for n in (3, 16, 32, 256, 512):
        assert g1.count([g1.text(n)]) == [n]
    assert tokenizers


def test_slope():
    assert slope_mb_per_min([(0, 100.0), (60, 101.0), (120, 102.0)]) == pytest.approx(1.0)
    assert slope_mb_per_min([(0, 5.0)]) == 0.0


def _res():
    rows = [
        {"scenario": "1-online", "target": "ceiling-onnx", "kind": "ceiling", "p50_ms": 4.0, "texts_s": 250.0},
        {"scenario": "1-online", "target": "embedops-onnx", "kind": "http", "concurrency": 1, "ok": 10,
         "p50_ms": 6.0, "p99_ms": 9.0, "req_s": 150.0},
        {"scenario": "2-c16", "target": "ceiling-onnx", "kind": "ceiling", "texts_s": 200.0},
        {"scenario": "2-c16", "target": "embedops-onnx", "kind": "http", "concurrency": 16, "ok": 10,
         "texts_s": 180.0, "req_s": 180.0, "p50_ms": 80.0, "p99_ms": 100.0},
        {"scenario": "2-c16", "target": "infinity", "kind": "http", "concurrency": 16, "ok": 10,
         "texts_s": 45.0, "req_s": 45.0, "p50_ms": 350.0, "p99_ms": 437.0},
        {"scenario": "3-ingest", "target": "ceiling-onnx", "kind": "ceiling", "tokens_s": 1000.0},
        {"scenario": "3-ingest", "target": "embedops-onnx", "kind": "http", "concurrency": 2, "ok": 4,
         "tokens_s": 850.0},
        {"scenario": "4-rerank", "target": "embedops-torch", "kind": "http", "na": "n/a"},
    ]
    return {"rows": rows, "rss": {"embedops-onnx": {"peak_rss_mb": 300.0}}, "errors": {"x": "boom\nmore"},
            "meta": {}}


def test_ratios_and_targets():
    r = {(x["scenario"], x["target"]): x for x in report.ratios(_res())}
    assert r[("1-online", "embedops-onnx")]["over_ceiling_ms"] == pytest.approx(2.0)
    assert r[("1-online", "embedops-onnx")]["vs_ceiling"] == pytest.approx(4 / 6)
    assert r[("2-c16", "embedops-onnx")]["vs_ceiling"] == pytest.approx(0.9)
    assert r[("2-c16", "embedops-onnx")]["vs_infinity"] == pytest.approx(4.0)
    assert r[("2-c16", "embedops-onnx")]["p99_vs_infinity"] == pytest.approx(4.37)
    checks = report.targets_check(_res())
    assert any("85%" in c and "MISSED" in c for c in checks)
    assert any("4.00x infinity" in c and "met" in c for c in checks)
    assert any("+2.00 ms" in c and "met" in c for c in checks)


def test_table_renders(tmp_path):
    text = report.table(_res())
    assert "embedops-onnx" in text and "n/a" in text and "could not run" in text
    pytest.importorskip("matplotlib")
    paths = report.plots(_res(), tmp_path, "t")
    assert paths and paths[0].exists() and paths[0].stat().st_size > 1000


def test_gpu_memory_parsers():
    m = "# HELP x\nembedops_gpu_memory_max_allocated_bytes 2147483648\nte_queue_size 0\n"
    assert report.gpu_memory_from_metrics(m, None) == pytest.approx(2048.0)
    assert report.gpu_memory_from_metrics("te_queue_size 1\n", json.dumps({"gpu": {"memory_mb": 512}})) == 512
    assert report.gpu_memory_from_metrics(None, None) is None
    assert math.isnan(report._ratio(None, 1, "higher"))


def test_median_rows_and_batch_counters():
    rows = [{"scenario": "2-c16", "target": "a", "req_s": v, "concurrency": 16, "round": i}
            for i, v in enumerate([3.0, 1.0, 2.0])] + [{"scenario": "4-rerank", "target": "b", "na": "x"}]
    m = {r["target"]: r for r in report.median_rows(rows)}
    assert m["a"]["req_s"] == 2.0 and m["a"]["rounds"] == 3 and m["a"]["concurrency"] == 16
    assert m["b"]["na"] == "x"
    text = ('te_batch_next_size_sum 120.0\nte_batch_next_size_count 10.0\n'
            'te_batch_next_tokens_sum 3840.0\nte_batch_next_size_bucket{le="1.0"} 2.0\n')
    assert report.batch_counters(text) == {"batches": 10.0, "inputs": 120.0, "tokens": 3840.0}
    assert report.batch_counters("other 1\n") is None


def test_profile_overrides_keep_the_rest():
    from bench.workloads import PROFILES, customize

    full = PROFILES["full"]
    assert customize(full) is full
    p = customize(full, concurrencies=[16, 64], duration_s=20)
    assert p.concurrencies == [16, 64] and p.duration_s == 20 and p.mixed_duration_s == 20
    assert p.ingest_requests == full.ingest_requests and full.concurrencies == [4, 16, 32, 64]


def test_server_timing_parsed_and_tail_broken_down_by_stage():
    from bench.loadgen import parse_server_timing, tail_breakdown

    st = parse_server_timing('parse;dur=0.5, tokenize;dur=0.2, queue;dur=1, slot;dur=0, forward;dur=5.25, '
                             'wake;dur=0.3, respond;dur=0.25, total;dur=7.5, batch;desc=16, beside;desc="1", x;y=2')
    assert st == {"st_parse": 0.5, "st_tokenize": 0.2, "st_queue": 1.0, "st_slot": 0.0, "st_forward": 5.25,
                  "st_wake": 0.3, "st_respond": 0.25, "st_total": 7.5, "st_batch": 16.0, "st_beside": 1.0}
    # 200 requests: the slowest two lost their time in the forward, the rest in nothing special
    samples = []
    for i in range(200):
        fwd = 100.0 if i >= 198 else 5.0
        sm = {"st_parse": 0.5, "st_queue": 1.0, "st_forward": fwd, "st_total": fwd + 1.5, "st_batch": 4.0}
        samples.append(Sample(float(i), (fwd + 2.5) / 1000, True, 200, 1, 16, server_ms=sm))
    tail, mid, n = tail_breakdown(samples)
    assert n == 2
    assert tail["forward"] == pytest.approx(100.0) and mid["forward"] == pytest.approx(5.0)
    assert tail["client"] == pytest.approx(1.0) and tail["latency"] == pytest.approx(102.5)
    assert tail["batch"] == 4.0 and tail["tokenize"] == 0.0  # a stage a server did not send counts as 0
    st = summarize(samples)
    assert st.tail_n == 2 and st.tail_ms["forward"] == pytest.approx(100.0)
    assert st.server_p50_ms == {}  # only the x-*-time headers go there, not the Server-Timing stages
    assert summarize(samples[:10]).tail_ms == {}  # too few to speak of a 1% tail
    res = {"rows": [{"scenario": "2-c16", "target": "embedops-onnx", "concurrency": 16, **st.as_dict()}]}
    text = "\n".join(report.tail_lines(res))
    assert "p99+" in text and "100.00" in text


def test_tree_cpu_counts_the_children_of_a_server():
    """The bench's CPU per request reads the server's whole process tree (TEI's launcher script runs the binary
    as a child): a child burning CPU shows up, one sleeping does not."""
    import subprocess
    import sys

    from bench.procs import tree_cpu_s

    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; t = time.process_time()\\nwhile time.process_time() - t < 0.4: pass']); "
            "c.wait(); time.sleep(5)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        used = 0.0
        while time.monotonic() < deadline and used < 0.3:
            used = max(used, tree_cpu_s(parent.pid))
            time.sleep(0.05)
        assert used >= 0.3  # the child's busy loop, seen through the parent
    finally:
        parent.kill()
        parent.wait()
