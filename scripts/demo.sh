#!/usr/bin/env bash
# `make demo` / `make demo-down`: the local demo.
#   up    local upstream control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok nodes),
#         the operator in the background, examples/cpu-ingestion.yaml (all-MiniLM-L6-v2 on an AMX CPU
#         node), and the reconciled Deployment's server command run as a local process on
#         127.0.0.1:${EMBEDOPS_DEMO_PORT:-8080}; prints the curl that embeds through it.
#   down  stops everything `up` started (by PID). Logs: tests/cluster/.run/demo/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
case "${1:-up}" in
  up)   exec "$PY" -m tests.cluster.demo up ;;
  down) exec "$PY" -m tests.cluster.demo down ;;
  *)    echo "usage: $0 up|down" >&2; exit 2 ;;
esac
