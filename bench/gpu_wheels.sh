#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), once, before bench/gpu_check.sh is sent to the GPU machine:
# downloads, into .whl/ (gitignored), the Python 3.12 wheels the embedops server needs that the GPU image
# lacks (it has torch, transformers, tokenizers, onnxruntime, numpy, aiohttp, prometheus-client, psutil).
# Versions follow this checkout's .venv so both machines run the same server stack.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ver() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
mkdir -p .whl
for pkg in fastapi starlette pydantic pydantic_core annotated-types typing-inspection annotated-doc orjson uvicorn h11 \
           typing_extensions anyio; do
  v=$(ver "$pkg"); [ -n "$v" ] || { echo "not in $PY: $pkg" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$pkg==$v"
done
ls -la .whl
