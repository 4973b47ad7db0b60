"""`embedops-server`: TEI's flag names and defaults (port 8080 here), each also read from UPPER_SNAKE env."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from .settings import Settings

_TRUE = {"1", "true", "yes", "on"}


def _bool(v: str) -> bool:
    if v.lower() in _TRUE:
        return True
    if v.lower() in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def _opt_int(v: str) -> int | None:
    return None if v.lower() in ("", "none") else int(v)


def _choice(*allowed: str):
    def parse(v: str) -> str:
        if v.lower() not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {v!r}")
        return v.lower()
    parse.__name__ = "one of " + "|".join(allowed)
    return parse


def _ranged(typ, lo, hi):
    def parse(v: str):
        x = typ(v)
        if not lo <= x <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo} to {hi}, got {v!r}")
        return x
    parse.__name__ = typ.__name__
    return parse


# (flag, type, default, help). Env var = flag without dashes, upper-snake.
FLAGS = [
    ("--model-id", str, None, "local model folder (Hugging Face layout)"),
    ("--revision", str, "main", "hub revision (branch, tag or commit) looked up in the Hugging Face cache; "
     "/info reports the commit served as model_sha"),
    ("--pooling", str, None, "cls | mean | splade | last-token (default: from 1_Pooling/config.json)"),
    ("--dtype", str, None, "float32 | float16 | bfloat16 (default: float16 on CUDA, float32 on CPU)"),
    ("--backend", str, "auto", "auto | torch | onnxruntime | hybrid (auto: torch on CUDA or for a float16/"
     "bfloat16 dtype, else ONNX Runtime for every task; hybrid: CPU, ONNX Runtime for inputs up to 128 tokens, "
     "torch for longer)"),
    ("--device", str, None, "cpu | cuda | cuda:N (default: cuda when available)"),
    ("--quantize", str, None, "int8: ONNX Runtime dynamic per-channel int8, refused below --int8-min-cosine"),
    ("--int8-min-cosine", float, 0.98, "minimum cosine vs float32 on the check sentences for int8"),
    ("--max-batch-tokens", int, 16384, "token budget per forward batch (padded: longest x count)"),
    ("--max-forward-tokens", _opt_int, None,
     "padded tokens per forward pass (default: the backend's efficient size on CPU, ONNX Runtime 256 with two "
     "forwards side by side, else 1024, torch 2048; unlimited on CUDA); 0 = up to --max-batch-tokens"),
    ("--max-input-length", _opt_int, None,
     "longest input in tokens (default: the model's); longer inputs are truncated or refused, and the start-up "
     "warm-up runs one input of this length: it bounds the attention memory a replica needs"),
    ("--max-batch-requests", _opt_int, None, "maximum inputs per forward batch"),
    ("--max-concurrent-requests", int, 512, "admitted inputs in flight before answering 429"),
    ("--max-client-batch-size", int, 32, "maximum inputs per request"),
    ("--lanes", _bool, True, "interactive and batch lanes: a query's inputs do not wait behind ingestion's "
     "(docs/server.md#lanes); false = one FIFO queue, as TEI"),
    ("--default-lane", _choice("auto", "interactive", "batch"), "auto", "the lane of a request whose client does "
     "not send an `embedops-lane` header; auto = interactive for a request of at most --lane-auto-max-inputs "
     "inputs and for /rerank, batch otherwise"),
    ("--lane-auto-max-inputs", _ranged(int, 0, 1 << 20), 4, "largest request (inputs) that --default-lane auto "
     "puts in the interactive lane"),
    ("--batch-lane-share", _ranged(float, 0.01, 1.0), 0.75, "share of --max-concurrent-requests the batch lane "
     "may hold in flight: past it batch requests get 429 while interactive ones are still admitted"),
    ("--batch-port", _ranged(int, 0, 65535), 0, "a second port for the same API whose requests default to the "
     "batch lane (an address for ingestion jobs: the operator's <name>-batch Service); 0 = none"),
    ("--batch-lane-nice", _ranged(int, 0, 19), 10, "nice value of the batch lane's inference threads where the "
     "lanes run side by side (ONNX Runtime on CPU); 0 = the same priority as queries"),
    ("--auto-truncate", _bool, True, "truncate over-long inputs when the request does not say"),
    ("--tokenization-workers", _opt_int, None, "tokenizer threads (default: CPUs - 1, at least 1)"),
    ("--num-threads", _opt_int, None, "intra-op threads for inference (default: CPUs allowed by cgroup)"),
    ("--default-prompt", str, None, "prefix added to every input"),
    ("--default-prompt-name", str, None, "key of `prompts` in config_sentence_transformers.json"),
    ("--served-model-name", str, None, "model name reported by the OpenAI routes"),
    ("--api-key", str, None, "require `Authorization: Bearer <key>` on inference routes"),
    ("--payload-limit", int, 2_000_000, "maximum request body in bytes"),
    ("--hostname", str, "0.0.0.0", "address to bind"),
    ("--port", int, 8080, "port for the API, /health and /metrics"),
    ("--graceful-shutdown-timeout", float, 30.0, "seconds to finish in-flight requests after SIGTERM"),
    ("--max-connection-age", float, 0.0, "seconds after which a keep-alive connection is closed after its next "
     "answer (Connection: close), so clients follow the Service to new pods (a promoted embedding space, added "
     "replicas); 0 = never"),
    ("--onnx-cache", str, None, "where ONNX exports and int8 models are written (default ~/.cache/embedops)"),
    ("--log-level", str, "info", "debug | info | warning | error"),
    ("--outputs", str, None, "comma-separated outputs the model must give (dense, sparse, colbert: bge-m3's "
     "heads); the server refuses to start when one is missing instead of answering 424 per request"),
    ("--cors-allow-origin", str, None, "browser origins allowed to call the API (comma-separated, or *); "
     "preflights allow Authorization as well as Content-Type. Default: no CORS headers"),
]


def env_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> Settings:
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="embedops-server", description=__doc__)
    for flag, typ, default, help_ in FLAGS:
        name = env_name(flag)
        raw = env.get(name)
        if flag == "--hostname" and raw is not None:
            try:  # Docker/Kubernetes set HOSTNAME to the pod name: only an IP address counts.
                ipaddress.ip_address(raw)
            except ValueError:
                raw = None
        value = default
        if raw is not None and raw != "":
            try:
                value = typ(raw)
            except (ValueError, argparse.ArgumentTypeError) as e:
                p.error(f"environment variable {name}: {e}")
        if typ is _bool:
            p.add_argument(flag, type=_bool, nargs="?", const=True, default=value, help=f"{help_} [env {name}]")
        else:
            p.add_argument(flag, type=typ, default=value, help=f"{help_} [env {name}]")
    p.add_argument("--json-output", action="store_true",
                   default=env.get("JSON_OUTPUT", "").lower() in _TRUE, help="JSON logs [env JSON_OUTPUT]")
    a = p.parse_args(argv)
    if not a.model_id:
        p.error("--model-id (or MODEL_ID) is required")
    kw = {k: v for k, v in vars(a).items() if k in Settings.__dataclass_fields__}
    return Settings(**kw)


def setup_logging(s: Settings) -> None:
    level = getattr(logging, s.log_level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    if s.json_output:
        from .logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Everything goes through this handler, so --json-output yields only JSON lines: Python warnings too,
    # and no progress bars from transformers / huggingface_hub.
    logging.captureWarnings(True)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.disable_default_handler()
        tlog.enable_propagation()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    """`embedops-server [flags]` serves; `embedops-server prepare [flags]` (the same flags) makes the ONNX
    cache entry those flags need (export, int8 and its gate, fused graph) and exits (prepare.py)."""
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, leaving the cores to the
    # tokenizers and the event loop (measured on 2 shared cores: ~2x saturated torch-CPU throughput).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:
        s = parse_args(argv[1:])
        setup_logging(s)
        from .prepare import main as prepare_main

        sys.exit(prepare_main(s))
    s = parse_args(argv)
    setup_logging(s)
    # Settings' repr hides api_key; log it as a boolean only.
    logging.getLogger("embedops_server").info("starting with %r (api key set: %s)", s, bool(s.api_key))
    from .router.server import serve

    serve(s)


if __name__ == "__main__":
    main()
