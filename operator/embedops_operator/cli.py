"""`embedops-operator`: run the operator, render manifests offline, print the CRD."""
from __future__ import annotations

import argparse
import logging
import sys

from embedops_server.logs import JsonFormatter  # the server's log lines, the same fields
from pydantic import ValidationError

from . import render, spec, yamlio
from .settings import OperatorSettings


def _setup_logging(fmt: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:  # kopf reports every event handler call at INFO; keep its warnings and errors
        for noisy in ("kopf.objects", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_run(args: argparse.Namespace) -> int:
    import functools

    import kopf

    _setup_logging(args.log_format, args.verbose)
    flags = {"namespaces": [n for arg in args.namespace for n in arg.split(",") if n] or None,
             "resync_seconds": args.resync_seconds, "stall_after_seconds": args.stall_after_seconds,
             "kube_api_qps": args.kube_api_qps, "kube_api_burst": args.kube_api_burst}
    settings = load_settings({k: v for k, v in flags.items() if v is not None})
    if settings is None:
        return 2
    namespaces = list(settings.namespaces)
    from . import handlers  # registers the handlers
    from . import metrics

    handlers.configure(settings)
    from .runtime import leader

    access = None
    if args.metrics_address and args.metrics_auth == "kubernetes":
        from kubernetes import client as k8s

        from .apply import Kube
        from .metrics_access import KubernetesAccessReview

        access = KubernetesAccessReview(k8s.ApiClient(Kube.configuration()))
    # every replica serves: a follower reports embedops_operator_leader 0
    metrics.serve(args.metrics_address, access, args.metrics_cert_dir or None)

    # kopf's own peering stays off (standalone); with --leader-elect, leader.py runs kopf only while this
    # process holds the Lease and exits 1 when it loses it
    return leader.run(functools.partial(kopf.operator, standalone=True, clusterwide=not namespaces,
                                        namespaces=namespaces), args)


def cmd_render(args: argparse.Namespace) -> int:
    source = "<stdin>" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
        docs = yamlio.load_all(text, source)
    except (OSError, UnicodeDecodeError, yamlio.ManifestError) as e:
        msg = str(e) if isinstance(e, yamlio.ManifestError) else f"{source}: cannot read: {e}"
        print(f"embedops-operator render: {' '.join(msg.split())}", file=sys.stderr)
        return 1
    capabilities = frozenset(render.OPTIONAL_KINDS)
    if args.without:
        skip = {k.lower() for k in args.without}
        capabilities = frozenset(c for c in capabilities if c[1].lower() not in skip)
    settings = load_settings({})
    if settings is None:
        return 2
    options = render.Options.of(settings, capabilities)
    from .validate import validate

    out: list[dict] = []
    failed = False
    for doc in docs:
        if doc.get("kind") != spec.KIND:
            continue
        if not isinstance(doc.setdefault("metadata", {}), dict):
            print(f"{spec.KIND}: metadata must be a mapping", file=sys.stderr)
            failed = True
            continue
        doc["metadata"].setdefault("namespace", args.namespace)
        errors = validate(doc)
        if errors:
            failed = True
            name = doc["metadata"].get("name", "?")
            for err in errors:
                print(f"{spec.KIND} {name}: {err}", file=sys.stderr)
            continue
        out.extend(render.render(doc, options))
    if failed:
        return 1
    sys.stdout.write(yamlio.dump_all(out))
    return 0


def load_settings(flags: dict) -> OperatorSettings | None:
    """The operator's settings from its flags, then its EMBEDOPS_* variables; None (and one line per bad value on
    stderr) when one does not validate."""
    try:
        return OperatorSettings(**flags)
    except ValidationError as e:
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            source = f"--{field.replace('_', '-')}" if field in flags else OperatorSettings.env_name(field)
            print(f"embedops-operator: {source}: {err['msg']}, got {err.get('input')!r}", file=sys.stderr)
        return None


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(yamlio.dump(spec.crd()))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embedops-operator", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (kopf) against the current kubeconfig / in-cluster")
    run.add_argument("--log-format", choices=["text", "json"], default="text")
    run.add_argument("--verbose", action="store_true")
    run.add_argument("-n", "--namespace", action="append", default=[],
                     help="namespace to watch (repeat or comma-separate); default: $EMBEDOPS_NAMESPACES, else all")
    run.add_argument("--resync-seconds", type=float, default=None,
                     help="seconds between full re-reconciles (default: $EMBEDOPS_RESYNC_SECONDS, else 60)")
    run.add_argument("--stall-after-seconds", type=float, default=None,
                     help="seconds a pod may stay pending or failing before Stalled (default: "
                          "$EMBEDOPS_STALL_AFTER_SECONDS, else 60)")
    run.add_argument("--kube-api-qps", type=float, default=None,
                     help="requests a second to the API server on average, watches aside (default: "
                          "$EMBEDOPS_KUBE_API_QPS, else 50; 0: no bound)")
    run.add_argument("--kube-api-burst", type=int, default=None,
                     help="requests at once above that rate (default: $EMBEDOPS_KUBE_API_BURST, else 100)")
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                     help="liveness endpoint URL ('' to disable)")
    run.add_argument("--metrics-address", default="0.0.0.0:8081",
                     help="host:port serving the operator's Prometheus /metrics ('' to disable)")
    run.add_argument("--metrics-auth", choices=["kubernetes", "none"], default="kubernetes",
                     help="who may read /metrics: 'kubernetes' (a bearer token the API server authenticates and "
                          "authorizes for GET /metrics, as for a kubelet's metrics) or 'none' (anyone who "
                          "reaches the port: every watched service's name and state)")
    run.add_argument("--metrics-cert-dir", default="",
                     help="folder with tls.crt and tls.key: serve /metrics over HTTPS (e.g. a cert-manager "
                          "Secret); default plain HTTP")
    from .runtime.leader import add_arguments as leader_arguments
    leader_arguments(run)
    run.set_defaults(func=cmd_run)
    ren = sub.add_parser("render", help="print the manifests the operator would apply (no cluster needed)")
    ren.add_argument("-f", "--file", required=True, help="EmbeddingService manifest(s); '-' for stdin")
    ren.add_argument("-n", "--namespace", default="default", help="namespace when the manifest has none")
    ren.add_argument("--without", action="append", default=[],
                     help="pretend an optional CRD is absent: ServiceMonitor, HTTPRoute, ScaledObject")
    ren.set_defaults(func=cmd_render)
    crd = sub.add_parser("crd", help="print the EmbeddingService CustomResourceDefinition")
    crd.set_defaults(func=cmd_crd)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
