#!/usr/bin/env bash
# `make demo` / `make demo-down`: the local demo.
#   up    local upstream control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok nodes) with
#         its real node cpu-real-0 (kubelet, kube-proxy, containerd, CNI, CoreDNS), the operator in the
#         background, the CPU server image imported into the node, and examples/cpu-ingestion.yaml
#         (all-MiniLM-L6-v2) placed on the real node, running in a real container; prints the curl that
#         embeds through its Service. Where no real node can run, the reconciled server command runs as a
#         local process on 127.0.0.1:${EMBEDOPS_DEMO_PORT:-8080} instead (the reason is printed).
#   down  stops everything `up` started (processes, the node's containers, mounts and network).
#         Logs: .run/demo/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
case "${1:-up}" in
  up)   exec "$PY" -m localcluster.demo up ;;
  down) exec "$PY" -m localcluster.demo down ;;
  *)    echo "usage: $0 up|down" >&2; exit 2 ;;
esac
