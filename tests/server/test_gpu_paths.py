"""GPU-only features whose logic runs on CPU: shape buckets for CUDA graphs, the GPU memory gauge."""
from __future__ import annotations

from embedops_server.backends import torch_backend as tb
from embedops_server.router.metrics import Metrics


def test_gpu_buckets_are_few_and_cover_the_batch():
    shapes = set()
    for rows in range(1, 65):
        for cols in range(1, 513):
            r, c = tb.gpu_bucket(rows, cols)
            assert r >= rows and c >= cols and r & (r - 1) == 0
            assert c % 16 == 0
            g = tb.graph_shape(r, c)
            if g is not None:
                assert g == (r, c) and r * c <= tb.GRAPH_MAX_TOKENS and r <= tb.GRAPH_MAX_ROWS
                assert c <= max(32, cols * 1.5)  # graph columns: at most half again the longest
                shapes.add(g)
    assert len(shapes) <= tb.GRAPH_MAX_COUNT  # every small batch has a graph; captures stay bounded
    assert tb.gpu_bucket(1, 5) == (1, 16) and tb.gpu_bucket(3, 17) == (4, 32)
    assert tb.graph_shape(*tb.gpu_bucket(1, 30)) == (1, 32)
    assert tb.graph_shape(*tb.gpu_bucket(64, 32)) is None  # large batches run eagerly
    assert tb.graph_shape(*tb.gpu_bucket(16, 300)) is None
    assert tb.graph_shape(3, 32) is None and tb.graph_shape(4, 40) is None  # not a bucket shape


def test_cpu_backend_has_no_graphs_and_no_gpu_memory(minilm_torch):
    from tests.server.conftest import STATES

    backend = STATES[minilm_torch].service.backend
    assert backend._graphs is None and backend.memory_stats() is None
    import httpx

    assert "embedops_gpu_memory_bytes{" not in httpx.get(minilm_torch + "/metrics").text


def test_gpu_memory_gauge_renders():
    m = Metrics()
    m.update_gpu(None)
    assert b"embedops_gpu_memory_bytes{" not in m.render()
    m.update_gpu({"allocated": 1024, "reserved": 2048, "max_allocated": 4096})
    text = m.render().decode()
    assert 'embedops_gpu_memory_bytes{kind="max_allocated"} 4096.0' in text
    assert 'embedops_gpu_memory_bytes{kind="reserved"} 2048.0' in text
