#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite on a kind cluster, the path users' CI takes (.github/workflows/e2e-kind.yaml).
# Creates the cluster from kind-config.yaml, advertises 7 MIG slices on the GPU-like worker, installs the
# upstream third-party CRDs, loads the operator and CPU server images into every node and runs tests/e2e against
# it through KUBECONFIG (the same suite as on the local control plane).
#
# Two container engines, the same steps; only where the images come from differs:
#   docker (GitHub runners): kind's own node image (kind-config.yaml), the images built from the repository's
#     Dockerfiles (operator/Dockerfile, server/Dockerfile.cpu) and `kind load docker-image`;
#   podman (this project's machines, no registry, no Docker engine): kind as KIND_EXPERIMENTAL_PROVIDER=podman,
#     the node image built here (python -m localcluster.kindnode build: docs/kind.md), the images built by
#     localcluster/images.py and `kind load image-archive`.
#   KEEP_CLUSTER=1   leave the cluster running afterwards (a second run reuses it)
#   E2E_TESTS=...    the test paths (default tests/e2e); PYTEST_ARGS: more pytest arguments
#   ENGINE=docker|podman   force one (default: docker when its engine answers, else podman)
set -euo pipefail
cd "$(dirname "$0")/../.."
CLUSTER=embedops-e2e
PY=${PY:-.venv/bin/python}
if [ -z "${ENGINE:-}" ]; then
  # a Docker engine that answers (a docker client alone is not one), else podman
  if docker info >/dev/null 2>&1; then ENGINE=docker; elif command -v podman >/dev/null; then ENGINE=podman; else
    echo "e2e-kind: needs a Docker engine or podman" >&2; exit 2
  fi
fi
components=(helm crds)   # helm and the upstream CRD files (no control plane build needed)
if [ "$ENGINE" = podman ]; then
  export KIND_EXPERIMENTAL_PROVIDER=podman
  components+=(kind)     # kind built from its Go module
  # kind mounts /lib/modules into every node read-only; a host without the folder fails at "Preparing nodes"
  [ -d /lib/modules ] || mkdir -p /lib/modules
  # workers join the control plane by name: podman's CNI networks answer names only with the dnsname plugin
  if [ "$(podman info --format '{{.Host.NetworkBackend}}')" = cni ] && [ ! -e /usr/lib/cni/dnsname ] \
     && [ ! -e /opt/cni/bin/dnsname ]; then
    echo "e2e-kind: podman's CNI networks need the dnsname plugin (scripts/host-packages.sh installs it)" >&2; exit 2
  fi
  if [ "$(podman network inspect kind --format '{{.DNSEnabled}}' 2>/dev/null || true)" = false ]; then
    echo "e2e-kind: podman network 'kind' was made without DNS (before the dnsname plugin): podman network rm kind" >&2
    exit 2
  fi
fi
"$PY" -m localcluster.build "${components[@]}"
if [ "$ENGINE" = podman ]; then
  KIND=${KIND:-$("$PY" -c 'from localcluster.components import provided; print(provided("kind"))')}
else
  KIND=${KIND:-kind}
fi
command -v "$KIND" >/dev/null || { echo "e2e-kind: kind not on PATH (go install sigs.k8s.io/kind@v0.30.0)" >&2; exit 2; }

create=(--config kind-config.yaml --wait 180s)
if [ "$ENGINE" = podman ]; then
  node_image="$("$PY" -m localcluster.kindnode build)"
  create+=(--image "$node_image")   # every node of kind-config.yaml, instead of kindest/node from a registry
fi

# The models the e2e PersistentVolumes serve: the bundled all-MiniLM-L6-v2 and a tiny cross-encoder (and, made
# by the bge-m3 test, bge-m3 at its real size), world-readable for the server's uid 10001, in the host folder
# kind-config.yaml mounts into every worker at the same path; beside it the prepared-graph cache the server
# writes. Made before the cluster, which needs the folders to exist.
# The folder is mounted, not the models folder itself: prepare_models replaces that folder whole (a rename),
# which a bind mount of it would not see.
export EMBEDOPS_MODELS_HOSTPATH=/var/lib/embedops-kind/models EMBEDOPS_E2E_MODELS_HOSTPATH=/var/lib/embedops-kind/models
if [ ! -d /var/lib/embedops-kind ]; then   # GitHub's runner user is not root (its sudo asks no password)
  if [ -w /var/lib ]; then mkdir /var/lib/embedops-kind; else sudo mkdir /var/lib/embedops-kind && sudo chown "$(id -u)" /var/lib/embedops-kind; fi
fi
mkdir -p "$EMBEDOPS_MODELS_HOSTPATH-onnx-cache"
chmod 0755 /var/lib/embedops-kind; chmod 0777 "$EMBEDOPS_MODELS_HOSTPATH-onnx-cache"
"$PY" -c "import sys; from pathlib import Path; from localcluster.models import prepare_models; prepare_models(Path(sys.argv[1]))" "$EMBEDOPS_MODELS_HOSTPATH"

# Outputs are captured, then matched: `cmd | grep -q` / `cmd | head` under pipefail fail at random (SIGPIPE).
clusters="$("$KIND" get clusters 2>/dev/null || true)"
if [[ $'\n'"$clusters"$'\n' != *$'\n'"$CLUSTER"$'\n'* ]]; then
  "$KIND" create cluster "${create[@]}"
fi
kc="$(mktemp)"; "$KIND" get kubeconfig --name "$CLUSTER" > "$kc"
export KUBECONFIG="$kc"
[ "${KEEP_CLUSTER:-}" = 1 ] || trap '"$KIND" delete cluster --name "$CLUSTER"; rm -f "$kc"' EXIT

# What NVIDIA's device plugin would advertise on a MIG-partitioned H100-80GB (mixed strategy).
gpu_nodes="$(kubectl get nodes -l embedops.dev/pool=gpu -o name)"
gpu_node="${gpu_nodes%%$'\n'*}"
kubectl patch "$gpu_node" --subresource=status --type=merge \
  -p '{"status":{"capacity":{"nvidia.com/mig-1g.10gb":"7"},"allocatable":{"nvidia.com/mig-1g.10gb":"7"}}}'

# Images: the operator and the CPU server image, loaded into every node. kind pods run real containers, so the
# operator (run by the suite as a local process) is pointed at the server image for CPU and GPU pods alike (kind
# workers have no GPU). The server image is tagged per tree so a rebuilt one is really rolled out (a fixed tag
# with IfNotPresent would keep the first image on the node).
if [ "$ENGINE" = docker ]; then
  # the repository's Dockerfiles with their public defaults (CPU torch from PyTorch's index)
  tag="e2e-$(git rev-parse --short HEAD 2>/dev/null || echo local)"
  declare -A dockerfile=([operator]=operator/Dockerfile [server]=server/Dockerfile.cpu)
  for img in operator server; do
    docker build -t "embedops-$img:$tag" -f "${dockerfile[$img]}" .
    "$KIND" load docker-image "embedops-$img:$tag" --name "$CLUSTER"
  done
  server_image="embedops-server:$tag" operator_image="embedops-operator:$tag"
else
  # localcluster/images.py: the same Dockerfiles on a Debian base made here, tagged by content
  built="$("$PY" -m localcluster.images build server operator)"
  read -r server_image server_archive operator_image operator_archive < <("$PY" -c '
import json, sys
b = json.loads(sys.stdin.read())["images"]
print(b["server"]["ref"], b["server"]["archive"], b["operator"]["ref"], b["operator"]["archive"])' <<<"$built")
  "$KIND" load image-archive "$server_archive" --name "$CLUSTER"
  "$KIND" load image-archive "$operator_archive" --name "$CLUSTER"
fi
export EMBEDOPS_SERVER_IMAGE_CPU="$server_image" EMBEDOPS_SERVER_IMAGE_CUDA="$server_image"
export EMBEDOPS_OPERATOR_IMAGE="$operator_image"
# images a test builds itself (the pgvector image of the reindex test) reach the nodes the same way
export EMBEDOPS_E2E_IMAGE_LOADER="$KIND load image-archive --name $CLUSTER"
# tests/e2e/test_real_pods.py: real containers on the plain CPU worker
export EMBEDOPS_E2E_REAL_PODS=1 EMBEDOPS_E2E_REAL_NODE_SELECTOR=embedops.dev/pool=cpu-plain

EMBEDOPS_E2E_KUBECONFIG="$kc" "$PY" -m pytest ${E2E_TESTS:-tests/e2e} -m cluster ${PYTEST_ARGS:-}
