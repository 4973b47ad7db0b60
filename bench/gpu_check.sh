#!/usr/bin/env bash
# The GPU profile in ONE short script (about 3-5 minutes on an H200, model building included).
# On the GPU machine, from the repository root, with .whl/ carried (made here by bench/gpu_wheels.sh):
#     bash bench/gpu_check.sh            # writes $OUT (or bench/results) gpu-*.json and the server logs
# It installs the carried wheels into /tmp/site (no network), then runs `python3 -m bench --gpu`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUTDIR=${OUT:-bench/results}
mkdir -p "$OUTDIR"
timeout ${GPU_CHECK_TIMEOUT:-540} python3 -m bench --gpu --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/gpu_check.log"
rc=${PIPESTATUS[0]}
for f in "$OUTDIR"/logs/*.log; do [ -f "$f" ] && tail -n 40 "$f" > "$OUTDIR/$(basename "$f")"; done
exit $rc
