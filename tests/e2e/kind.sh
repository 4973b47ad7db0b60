#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite on a kind cluster (hosts with Docker; GitHub runners). Creates the
# cluster from kind-config.yaml, advertises 7 MIG slices on the GPU-like worker, installs the upstream
# third-party CRDs, builds and loads the operator and CPU server images (operator/Dockerfile,
# server/Dockerfile.cpu), and
# runs tests/e2e against it through KUBECONFIG (the same suite as on the local control plane).
#   KEEP_CLUSTER=1   leave the cluster running afterwards
set -euo pipefail
cd "$(dirname "$0")/../.."
CLUSTER=embedops-e2e
KIND=${KIND:-kind}
PY=${PY:-.venv/bin/python}
command -v docker >/dev/null || { echo "e2e-kind: needs a Docker engine (this host has none); the local control plane runs the same suite: make test" >&2; exit 2; }
command -v "$KIND" >/dev/null || { echo "e2e-kind: kind not on PATH (go install sigs.k8s.io/kind@v0.30.0)" >&2; exit 2; }

"$PY" -m localcluster.build helm crds   # helm and the upstream CRD files (no control plane build needed)

# Outputs are captured, then matched: `cmd | grep -q` / `cmd | head` under pipefail fail at random (SIGPIPE).
clusters="$("$KIND" get clusters 2>/dev/null || true)"
if [[ $'\n'"$clusters"$'\n' != *$'\n'"$CLUSTER"$'\n'* ]]; then
  "$KIND" create cluster --config kind-config.yaml --wait 120s
fi
kc="$(mktemp)"; "$KIND" get kubeconfig --name "$CLUSTER" > "$kc"
export KUBECONFIG="$kc"
[ "${KEEP_CLUSTER:-}" = 1 ] || trap '"$KIND" delete cluster --name "$CLUSTER"; rm -f "$kc"' EXIT

# What NVIDIA's device plugin would advertise on a MIG-partitioned H100-80GB (mixed strategy).
gpu_nodes="$(kubectl get nodes -l embedops.dev/pool=gpu -o name)"
gpu_node="${gpu_nodes%%$'\n'*}"
kubectl patch "$gpu_node" --subresource=status --type=merge \
  -p '{"status":{"capacity":{"nvidia.com/mig-1g.10gb":"7"},"allocatable":{"nvidia.com/mig-1g.10gb":"7"}}}'

# Images: the operator and the CPU server image, built from the repository's Dockerfiles with their public
# defaults (CPU torch from PyTorch's index) and loaded into every node. kind pods run real containers, so the
# operator (run by the suite as a local process) is pointed at the locally built server image for CPU and GPU
# pods alike (kind workers have no GPU), and the bundled MiniLM is copied to the hostPath the e2e model
# PersistentVolume uses on every worker. The server image is tagged per tree so a rebuilt one is really
# rolled out (a fixed tag with IfNotPresent would keep the first image on the node).
tag="e2e-$(git rev-parse --short HEAD 2>/dev/null || echo local)"
declare -A dockerfile=([operator]=operator/Dockerfile [server]=server/Dockerfile.cpu)
for img in operator server; do
  docker build -t "embedops-$img:$tag" -f "${dockerfile[$img]}" .
  "$KIND" load docker-image "embedops-$img:$tag" --name "$CLUSTER"
done
export EMBEDOPS_SERVER_IMAGE_CPU="embedops-server:$tag" EMBEDOPS_SERVER_IMAGE_CUDA="embedops-server:$tag"
export EMBEDOPS_OPERATOR_IMAGE="embedops-operator:$tag"
# The models the e2e PersistentVolume serves (hostPath /var/lib/embedops-models on every worker): the bundled
# all-MiniLM-L6-v2 and a tiny cross-encoder, world-readable for the server's uid 10001.
models="$(mktemp -d)/models"
"$PY" -c "import sys; from pathlib import Path; from localcluster.models import prepare_models; prepare_models(Path(sys.argv[1]))" "$models"
for n in $("$KIND" get nodes --name "$CLUSTER"); do
  docker exec "$n" mkdir -p /var/lib/embedops-models
  docker cp "$models/." "$n:/var/lib/embedops-models/"
done
# tests/e2e/test_real_pods.py: real containers on the plain CPU worker
export EMBEDOPS_E2E_REAL_PODS=1 EMBEDOPS_E2E_REAL_NODE_SELECTOR=embedops.dev/pool=cpu-plain

EMBEDOPS_E2E_KUBECONFIG="$kc" "$PY" -m pytest tests/e2e -m cluster ${PYTEST_ARGS:-}
