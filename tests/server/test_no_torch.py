"""The server without torch, as in the ONNX Runtime-only image: a folder with an ONNX file serves, one without
fails at start with one clear line and a non-zero exit. torch is blocked in a subprocess, not uninstalled."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from localcluster.models import minilm_dir, minilm_onnx_dir
from tests.server.conftest import free_port, wait_healthy

ROOT = Path(__file__).parents[2]
# sys.modules["torch"] = None makes `import torch` raise ImportError and importlib.util.find_spec("torch") return
# None, as if torch were not installed.
BLOCKED = "import sys; sys.modules['torch'] = None; from embedops_server.cli import main; main(sys.argv[1:])"


def _server(model: Path, port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BLOCKED, "--model-id", str(model), "--hostname", "127.0.0.1", "--port", str(port),
         "--tokenization-workers", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "server"), "HOME": "/tmp", "OMP_NUM_THREADS": "1",
             "EMBEDOPS_CACHE": "/nonexistent-no-export-expected"})


def test_folder_without_onnx_fails_with_one_clear_line():
    p = _server(minilm_dir(), free_port())
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 3, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "has no ONNX file" in line]
    assert len(lines) == 1 and "torch is not installed in this image" in lines[0], out
    assert "ship onnx/model.onnx in the model folder or use an image with torch" in lines[0]
    assert "ERROR" in lines[0]


def test_torch_backend_without_torch_is_a_model_error():
    p = _server(minilm_onnx_dir(), free_port(), "--backend", "torch", "--pooling", "mean")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 3 and "Traceback" not in out and "torch is not installed in this image" in out, out


def test_onnx_folder_serves_without_torch():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = _server(minilm_onnx_dir(), port, "--pooling", "mean")
    try:
        wait_healthy(url, 120, dead=lambda: None if p.poll() is None else f"exited {p.returncode}: {p.stdout.read()}")
        r = httpx.post(url + "/embed", json={"inputs": ["hello world"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()[0]) == 384
        assert httpx.get(url + "/info").json()["model_type"]  # /info answers without torch too
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown: -15 is a clean exit
    assert p.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out
