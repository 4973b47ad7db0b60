"""Gateway routes and LiteLLM on the real software (issue 19). Traefik v3, built from its Go module and run as
a pod on the real node (localcluster/gateway.py), reads the HTTPRoutes the operator renders; LiteLLM's proxy
(localcluster/litellm_proxy.py's image) runs as a pod reading the shared ConfigMap the operator writes,
mounted as a folder, and is rolled out by the operator when services come and go.

What a platform team finds out only in production, checked on real pods: the gateway accepts the route
(``Accepted`` and ``ResolvedRefs`` in its status, and the EmbeddingService's ``RoutesReady`` says so); every
route the service exposes answers through the gateway with the same bytes as the Service, the path prefix
stripped and the hostname honoured; what the service does not expose stays 404; a rollout under load through
the gateway loses no request. Bounded local load only.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from localcluster import gateway, litellm_proxy, tracing, vector_store
from localcluster.models import MINILM, RERANKER
from localcluster.workloads import REAL_NODE_TOLERATIONS, prerequisites
from embedops_operator.litellm import ANNOTATION_HASH as LITELLM_HASH
from embedops_operator.litellm import INDEX_KEY as LITELLM_INDEX
from embedops_operator.litellm import LABEL_CONSUMER as LITELLM_CONSUMER
from tests.e2e.conftest import GROUP, PLURAL, REPO, VERSION, wait_for
from tests.e2e.real_pods import LOAD_CLIENT, client_pod, pod_log
from tests.e2e.test_real_pods import (RERANKER_DOC, _kubeconfig, example, ns, on_real_node, real,  # noqa: F401
                                      rolled_out, stop_load, svc, wait_ready)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EMBED, RERANK, M3 = "routed-embed", "routed-rerank", "routed-m3"
M3_PREFIX = "/hybrid"  # beside /retrieval on the same hostname
EMBED_HOST, RERANK_HOST = "retrieval.e2e.embedops.test", "rerank.e2e.embedops.test"
PREFIX = "/retrieval"
TEXTS = ["What is a gateway?", "HTTPRoutes send requests to Services."]
QUERY = "Where is the Eiffel Tower?"
PASSAGES = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris."]


@pytest.fixture(scope="module")
def gw(kube, real):  # noqa: F811 - the fixture imported above
    if real.local_node is None:
        pytest.skip("the gateway is built into the local cluster only")
    return gateway.up(kube)


def tiny_m3(root: Path) -> str:
    """A small random model in bge-m3's layout (dense, sparse and ColBERT heads) with the server's own ONNX
    export, under the models hostPath the pods mount; made once per models folder."""
    from bench.m3_model import build_m3_folder
    from localcluster.models import _export

    dst = root / "tiny-bge-m3"
    if not (dst / "onnx" / "model.onnx").is_file():
        tmp = root / "tiny-bge-m3.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        _export(build_m3_folder(tmp))
        for d, _, files in os.walk(tmp):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
    return dst.name


@pytest.fixture(scope="module")
def routed(kube, real, ns, svc, gw):  # noqa: F811
    """An embedder behind the gateway at <EMBED_HOST>/retrieval (prefix stripped by the route's URLRewrite),
    a model in bge-m3's layout at <EMBED_HOST>/hybrid (one exact rule per output it has), and the tiny
    reranker at <RERANK_HOST>/ (no prefix)."""
    embed = on_real_node(example(), real)
    embed["metadata"]["name"] = EMBED
    embed["spec"]["gateway"] = {"parentRefs": [gateway.PARENT_REF], "hostnames": [EMBED_HOST], "pathPrefix": PREFIX,
                                "allowUnauthenticated": True, "embedAll": True}  # /embed_all routed on request
    rerank = on_real_node(RERANKER_DOC, real)
    rerank["metadata"]["name"] = RERANK
    rerank["spec"]["gateway"] = {"parentRefs": [gateway.PARENT_REF], "hostnames": [RERANK_HOST],
                                 "allowUnauthenticated": True}
    rerank["spec"]["batching"]["maxClientBatchSize"] = 64  # the query-time pattern reranks 50 candidates at once
    m3 = on_real_node(example(), real)
    m3["metadata"]["name"] = M3
    model = tiny_m3(Path(real.models_hostpath))
    m3["spec"]["model"] = {"id": f"/models/{model}", "servedModelName": model, "task": "embed", "maxInputLength": 256,
                           "outputs": ["dense", "sparse", "colbert"], "source": {"pvc": {"claimName": "embedops-models"}}}
    m3["spec"]["gateway"] = {"parentRefs": [gateway.PARENT_REF], "hostnames": [EMBED_HOST], "pathPrefix": M3_PREFIX,
                             "allowUnauthenticated": True}
    docs = [embed, rerank, m3]
    for d in docs:  # only their namespace (the tests' clients, LiteLLM) and the gateway's pods reach them
        d["spec"]["networkPolicy"] = {}
    prerequisites(kube, ns, docs, host_path=real.models_hostpath)
    for d in docs:
        svc.create(d)
    for d in docs:
        wait_ready(svc, d["metadata"]["name"], real)
    # Ready is not yet routable: Traefik forwards to the Service's cluster IP, and on this node a Service that just
    # got its first ready pod can refuse for a few seconds (kube-router restores a filter-table snapshot that still
    # held kube-proxy's "no endpoints" reject, kube-router#1248; docs/cluster.md). Each route answers once first.
    for path, host in ((PREFIX + "/embed", EMBED_HOST), (M3_PREFIX + "/embed", EMBED_HOST), ("/rerank", RERANK_HOST)):
        body = {"query": QUERY, "texts": PASSAGES} if path == "/rerank" else {"inputs": TEXTS[:1]}
        wait_for(lambda p=path, h=host, b=body: call(gw.url, p, b, host=h)[0] == 200, timeout=60,
                 what=f"{host}{path} answering through the gateway")
    return {d["metadata"]["name"]: d for d in docs}


def call(base: str, path: str, body=None, host: str | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body bytes) of one request; a GET when ``body`` is None."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Host": host} if host else {}), **(headers or {})}
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def without_id(body: bytes) -> dict:
    doc = json.loads(body)
    assert doc.pop("id", None), body
    return doc


def backend(svc, name: str) -> str:  # noqa: F811
    """The Service's one endpoint (its pod's IP and the port the Service targets), which this machine reaches
    on the node's bridge: what the gateway forwards to, without the gateway."""
    s = svc.core.read_namespaced_service(name, svc.ns)
    target = s.spec.ports[0].target_port
    (pod,) = [p for p in svc.pods(name) if p.metadata.deletion_timestamp is None]
    port = next(p.container_port for c in pod.spec.containers for p in c.ports or [] if p.name == target) \
        if isinstance(target, str) else target
    return f"http://{pod.status.pod_ip}:{port}"


def diagnostics(svc, name: str, gw=None) -> str:  # noqa: F811
    """What Traefik logged, the services it built and the EndpointSlices it reads, for a failure message."""
    from kubernetes import client

    built = ""
    if gw is not None:
        status, body = call(gw.api_url, "/http/services")
        built = "\n".join(f"{s['name']}: {s.get('loadBalancer', {}).get('servers')} {s.get('serverStatus')}"
                           for s in json.loads(body) if name in s["name"]) if status == 200 else body.decode()

    pods = svc.core.list_namespaced_pod(gateway.NAMESPACE, label_selector="app.kubernetes.io/name=traefik").items
    log = "\n".join(svc.core.read_namespaced_pod_log(p.metadata.name, gateway.NAMESPACE, tail_lines=30) for p in pods)
    slices = client.DiscoveryV1Api(svc.core.api_client).list_namespaced_endpoint_slice(
        svc.ns, label_selector=f"kubernetes.io/service-name={name}").items
    eps = [(s.metadata.name, [(p.name, p.port) for p in s.ports or []],
            [(e.addresses, e.conditions.ready) for e in s.endpoints or []]) for s in slices]
    return f"EndpointSlices of {svc.ns}/{name}: {eps}\nTraefik's services:\n{built}\nTraefik log:\n{log}"


def test_gateway_accepts_the_operators_routes_and_the_status_says_so(routed, gw, svc):  # noqa: F811
    for name in (EMBED, RERANK, M3):
        def accepted(name=name):
            route = svc.co.get_namespaced_custom_object("gateway.networking.k8s.io", "v1", svc.ns, "httproutes", name)
            parents = [p for p in (route.get("status") or {}).get("parents") or []
                       if p.get("controllerName") == gateway.CONTROLLER]
            conds = {c["type"]: c for p in parents for c in p.get("conditions") or []}
            if conds.get("Accepted", {}).get("status") == "True" and conds.get("ResolvedRefs", {}).get("status") == "True":
                return route
        route = wait_for(accepted, timeout=60, what=f"Traefik accepts HTTPRoute {name}")
        parent = route["status"]["parents"][0]["parentRef"]
        assert (parent["name"], parent.get("namespace")) == (gateway.GATEWAY, gateway.NAMESPACE), route["status"]
        es = svc.wait_condition(name, "RoutesReady", timeout=60)
        cond = {c["type"]: c for c in es["status"]["conditions"]}["RoutesReady"]
        print(f"{name}: RoutesReady {cond['status']} {cond['reason']}: {cond['message']}")
        assert cond["reason"] == "Accepted" and gateway.CONTROLLER in cond["message"]
    gwobj = svc.co.get_namespaced_custom_object("gateway.networking.k8s.io", "v1", gateway.NAMESPACE, "gateways",
                                                gateway.GATEWAY)
    assert {"type": "Hostname", "value": gateway.IN_CLUSTER_HOST} in gwobj["status"]["addresses"]
    listener = gwobj["status"]["listeners"][0]
    assert listener["attachedRoutes"] >= 3, listener


def test_every_exposed_route_answers_through_the_gateway_as_the_service_does(routed, gw, svc):  # noqa: F811
    direct = backend(svc, EMBED)
    calls = [("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": TEXTS}), ("/embed", {"inputs": TEXTS}),
             ("/embed_all", {"inputs": TEXTS[:1]}), ("/v1/models", None), ("/v1/models/all-MiniLM-L6-v2", None)]
    for path, body in calls:
        want = call(direct, path, body)
        got = call(gw.url, PREFIX + path, body, host=EMBED_HOST)
        assert want[0] == 200, (path, want)
        assert got == want, (f"{PREFIX + path} through the gateway: {got[0]} {got[1][:200]!r} != "
                             f"{want[1][:200]!r}\n{diagnostics(svc, EMBED, gw)}")
    # Cohere's v2 embed (its answer carries a fresh id per request; the rest must match)
    body = {"texts": TEXTS, "embedding_types": ["float", "ubinary"]}
    want, got = call(direct, "/v2/embed", body), call(gw.url, PREFIX + "/v2/embed", body, host=EMBED_HOST)
    assert want[0] == 200 and (got[0], without_id(got[1])) == (want[0], without_id(want[1])), (got[0], got[1][:200])
    rerank_direct = backend(svc, RERANK)
    for path in ("/rerank", "/v1/rerank"):
        body = ({"query": QUERY, "texts": PASSAGES} if path == "/rerank"
                else {"query": QUERY, "documents": PASSAGES, "top_n": 2})
        want = call(rerank_direct, path, body)
        assert want[0] == 200, (path, want)
        got = call(gw.url, path, body, host=RERANK_HOST)
        if path == "/v1/rerank":  # Cohere's answer carries a fresh id per request; the rest must match
            got, want = (got[0], without_id(got[1])), (want[0], without_id(want[1]))
        assert got == want, f"{path}: {got[0]} {got[1][:200]!r}\n{diagnostics(svc, RERANK, gw)}"
    # bge-m3's outputs: each has its exact rule, and /embed_hybrid exists because the model has several
    m3_direct = backend(svc, M3)
    for path, body in [("/embed_sparse", {"inputs": TEXTS}), ("/embed_colbert", {"inputs": TEXTS[:1]}),
                       ("/embed_hybrid", {"inputs": TEXTS, "outputs": ["dense", "sparse"]}),
                       ("/v1/embeddings", {"model": "tiny-bge-m3", "input": TEXTS})]:
        want = call(m3_direct, path, body)
        assert want[0] == 200, (path, want)
        got = call(gw.url, M3_PREFIX + path, body, host=EMBED_HOST)
        assert got == want, f"{M3_PREFIX + path}: {got[0]} {got[1][:200]!r}\n{diagnostics(svc, M3, gw)}"
    # a request the server refuses keeps its status and error body through the gateway
    bad = call(direct, "/embed", {"inputs": []})
    assert bad[0] == 400 and call(gw.url, PREFIX + "/embed", {"inputs": []}, host=EMBED_HOST) == bad, bad


def test_prefix_hostnames_and_unexposed_routes_are_404(routed, gw, svc):  # noqa: F811
    body = {"inputs": TEXTS[:1]}
    assert call(gw.url, PREFIX + "/embed", body, host=EMBED_HOST)[0] == 200
    refused = {
        "the path without its prefix": (gw.url, "/embed", EMBED_HOST),
        "another hostname": (gw.url, PREFIX + "/embed", "other.e2e.embedops.test"),
        "the reranker's hostname with the embedder's prefix": (gw.url, PREFIX + "/embed", RERANK_HOST),
        "an Exact path with a suffix": (gw.url, PREFIX + "/embed/extra", EMBED_HOST),
        "a route of another task (/rerank)": (gw.url, PREFIX + "/rerank", EMBED_HOST),
        "/predict": (gw.url, PREFIX + "/predict", EMBED_HOST),
        "/metrics (scraped in-cluster, never published)": (gw.url, PREFIX + "/metrics", EMBED_HOST),
        "/health": (gw.url, PREFIX + "/health", EMBED_HOST),
        "the embedder's /embed on the reranker's hostname": (gw.url, "/embed", RERANK_HOST),
        "bge-m3's /embed_sparse under the MiniLM prefix": (gw.url, PREFIX + "/embed_sparse", EMBED_HOST),
        "/embed_colbert under the MiniLM prefix": (gw.url, PREFIX + "/embed_colbert", EMBED_HOST),
        "/embed_hybrid under the MiniLM prefix": (gw.url, PREFIX + "/embed_hybrid", EMBED_HOST),
        "/rerank under the bge-m3 prefix": (gw.url, M3_PREFIX + "/rerank", EMBED_HOST),
    }
    got = {why: call(base, path, body, host=host)[0] for why, (base, path, host) in refused.items()}
    print(json.dumps(got, indent=1))
    assert set(got.values()) == {404}, got
    # the Service itself answers those paths: the 404s are the route's, not the server's
    assert call(backend(svc, EMBED), "/health")[0] == 200


def _space_of(base: str, path: str, host: str) -> tuple[int, str | None]:
    """(status, embedding-space header) of one /embed call."""
    req = urllib.request.Request(base + path, data=json.dumps({"inputs": TEXTS[:1]}).encode(),
                                 headers={"Content-Type": "application/json", "Host": host})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("embedding-space")
    except urllib.error.HTTPError as e:
        return e.code, None


def test_each_space_answers_on_its_own_gateway_route_during_a_migration(kube, routed, gw, svc, real):  # noqa: F811
    """Issue 36: during a change of the embedding space, each running space answers through the gateway under
    <pathPrefix>/spaces/<key> (status.spaces[].gatewayPath), while the service's own route keeps the serving
    space; the space routes go with the migration's end."""
    name, prefix = "routed-space", "/migrating"
    doc = on_real_node(example(), real)
    doc["metadata"]["name"] = name
    doc["spec"]["gateway"] = {"parentRefs": [gateway.PARENT_REF], "hostnames": [EMBED_HOST], "pathPrefix": prefix,
                              "allowUnauthenticated": True}
    doc["spec"]["accelerator"]["cpu"]["memory"] = "1Gi"
    doc["spec"]["networkPolicy"] = {}
    prerequisites(kube, svc.ns, [doc], host_path=real.models_hostpath)
    svc.create(doc)
    try:
        wait_ready(svc, name, real)
        svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", svc.ns, "embeddingservices", name,
                                              {"spec": {"model": {"pooling": "cls"}}})

        def both_up():
            spaces = {x["role"]: x for x in (svc.get(name).get("status") or {}).get("spaces") or []}
            ok = {"serving", "candidate"} <= set(spaces) and spaces["candidate"].get("ready") == "1/1" \
                and all(x.get("gatewayPath") and x.get("fingerprint") for x in spaces.values())
            return spaces if ok else None
        spaces = wait_for(both_up, timeout=240, what="the new space ready beside the old one, both with routes")

        def answered():
            got = {role: _space_of(gw.url, x["gatewayPath"] + "/embed", EMBED_HOST) for role, x in spaces.items()}
            got["service"] = _space_of(gw.url, prefix + "/embed", EMBED_HOST)
            return got if all(status == 200 for status, _ in got.values()) else None
        got = wait_for(answered, timeout=60, what="Traefik routes the spaces' routes")
        print(f"through the gateway during the migration: {got}; spaces {[(r, x['gatewayPath']) for r, x in spaces.items()]}")
        assert got["serving"][1] == spaces["serving"]["fingerprint"]
        assert got["candidate"][1] == spaces["candidate"]["fingerprint"] != spaces["serving"]["fingerprint"]
        assert got["service"][1] == spaces["serving"]["fingerprint"]  # the service's route: the serving space only
    finally:
        svc.delete(name)


def test_rollout_through_the_gateway_loses_no_request(kube, routed, gw, svc, real):  # noqa: F811
    before = {p.metadata.name for p in svc.pods(EMBED)}
    pod = client_pod("load-gateway", real.server_image, LOAD_CLIENT, real.node_selector, {
        "URL": f"{gw.in_cluster_url}{PREFIX}/embed", "HOST": EMBED_HOST, "THREADS": 4, "MAX_SECONDS": 300,
        "BODY": json.dumps({"inputs": ["steady load through the gateway"]})})
    svc.core.create_namespaced_pod(svc.ns, pod)
    wait_for(lambda: "started" in pod_log(svc.core, svc.ns, "load-gateway"), timeout=120,
             what="first success through the gateway")
    time.sleep(3)
    # what rolls the pods: traces turned on (spec.tracing, a new service name each run), as a platform team does
    svc.co.patch_namespaced_custom_object(GROUP, VERSION, svc.ns, PLURAL, EMBED, {"spec": {"tracing": {
        "endpoint": tracing.ENDPOINT, "serviceName": f"{EMBED}-{uuid.uuid4().hex[:8]}"}}})
    wait_for(lambda: rolled_out(svc, EMBED, 1) and not before & {p.metadata.name for p in svc.pods(EMBED)},
             timeout=300, what="rollout to a new pod")
    time.sleep(3)  # the new pod serves alone through the gateway for a moment
    summary = stop_load(kube, svc, "load-gateway")
    print(f"rollout under load (4 client threads through Traefik to the Service's pods): {summary}")
    assert summary["ok"] > 0 and summary["failed"] == 0, summary


@pytest.fixture(scope="module")
def collector(kube, real):  # noqa: F811
    if real.local_node is None:
        pytest.skip("the OpenTelemetry Collector is built into the local cluster only")
    return tracing.up(kube)


def test_a_trace_through_the_gateway_has_the_servers_stages_under_the_callers_span(
        kube, routed, gw, svc, collector, real):  # noqa: F811
    """Issue 54: a client's request through Traefik carries its W3C traceparent to the server, whose span (the
    EmbeddingService's name, or spec.tracing.serviceName) is the client's span's child in the real collector,
    with the request's seven stages under it."""
    spec = svc.co.get_namespaced_custom_object(GROUP, VERSION, svc.ns, PLURAL, EMBED)["spec"]
    if (spec.get("tracing") or {}).get("endpoint") != collector.endpoint:  # run alone: the rollout test did not
        before = {p.metadata.name for p in svc.pods(EMBED)}
        svc.co.patch_namespaced_custom_object(GROUP, VERSION, svc.ns, PLURAL, EMBED, {"spec": {"tracing": {
            "endpoint": collector.endpoint}}})
        wait_for(lambda: rolled_out(svc, EMBED, 1) and not before & {p.metadata.name for p in svc.pods(EMBED)},
                 timeout=300, what="rollout with tracing on")
        spec = svc.co.get_namespaced_custom_object(GROUP, VERSION, svc.ns, PLURAL, EMBED)["spec"]
    service_name = spec["tracing"].get("serviceName") or EMBED
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    wait_for(lambda: call(gw.url, PREFIX + "/embed", {"inputs": TEXTS}, host=EMBED_HOST)[0] == 200, timeout=60,
             what="the traced pod answering through the gateway")
    status, _ = call(gw.url, PREFIX + "/embed", {"inputs": TEXTS}, host=EMBED_HOST,
                     headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert status == 200
    spans: list[dict] = []

    def arrived() -> bool:
        spans[:] = [s for s in collector.spans(kube) if s["trace"] == trace_id]
        return len(spans) >= 8

    wait_for(arrived, timeout=60, what=f"trace {trace_id} in the collector's log")
    server = [s for s in spans if s["parent"] == parent]
    assert len(server) == 1, spans
    server = server[0]
    assert server["name"] == "POST /embed" and server["kind"] == "Server" and server["service"] == service_name
    assert server["attributes"]["embedops.inputs"] == len(TEXTS)
    stages = [s["name"] for s in spans if s["parent"] == server["id"]]
    assert sorted(stages) == sorted(["parse", "tokenize", "queue", "slot", "forward", "wake", "respond"]), spans


# ---------------------------------------------------------------------------------------------- LiteLLM

LITELLM_CM = "litellm-models"
LITELLM_UPSTREAM_IMAGE = "ghcr.io/berriai/litellm:main-stable"  # what examples/query-time/litellm.yaml names
LITELLM_PORT = 4000
MASTER = {"Authorization": f"Bearer {litellm_proxy.MASTER_KEY}"}


QUERY_TIME = REPO / "examples" / "query-time"


def example_manifests(file: str, ns: str, images: dict[str, str], node_selector: dict,
                      env: dict[str, str] | None = None, args: list[str] | None = None) -> list[dict]:
    """examples/query-time/<file> as this cluster runs it: in namespace ``ns``, each upstream image replaced by
    the local one ``images`` maps it to (no registry can be reached here), pods placed on the real node, and
    ``env`` values (the services' URLs, which name the test's services) and ``args`` replacing the example's."""
    docs = [d for d in yaml.safe_load_all((QUERY_TIME / file).read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = ns
        pod = (d.get("spec") or {}).get("template", {}).get("spec")
        if pod is None:
            continue
        pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **node_selector}
        pod["tolerations"] = list(pod.get("tolerations") or []) + REAL_NODE_TOLERATIONS
        for c in pod["containers"]:
            c["image"] = images[c["image"]]
            c["imagePullPolicy"] = "IfNotPresent"
            if env:
                kept = [e for e in c.get("env") or [] if e.get("name") not in env]
                c["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
            if args is not None:
                c["args"] = args
    return docs


def litellm_manifests(ns: str, image: str, node_selector: dict) -> list[dict]:
    """What a platform team writes for LiteLLM: examples/query-time/litellm.yaml (its config including the
    operator's index, the proxy's Deployment mounting the shared ConfigMap as a folder and labelled as its
    consumer, a Service), with this proxy's master key."""
    docs = example_manifests("litellm.yaml", ns, {LITELLM_UPSTREAM_IMAGE: image}, node_selector)
    for d in docs:
        if d["kind"] == "Secret":
            d["stringData"]["key"] = litellm_proxy.MASTER_KEY
    return docs


def litellm_pod(svc, template_hash: str | None = None):  # noqa: F811
    """The one ready LiteLLM pod (of the pod template carrying ``template_hash``, when given)."""
    pods = [p for p in svc.core.list_namespaced_pod(svc.ns, label_selector="app.kubernetes.io/name=litellm").items
            if p.metadata.deletion_timestamp is None and p.status.pod_ip
            and all(c.ready for c in p.status.container_statuses or [False])
            and (template_hash is None or (p.metadata.annotations or {}).get(LITELLM_HASH) == template_hash)]
    return pods[0] if len(pods) == 1 else None


def proxy_rollout(svc) -> str:  # noqa: F811
    """What a wait for the proxy's rollout ends on: the ConfigMap's hash and index, the Deployment's hash, and
    each LiteLLM pod (its hash, phase, readiness, restarts, why it waits, and the models it lists when ready)."""
    from kubernetes import client

    from embedops_operator import litellm as entries

    cm = svc.core.read_namespaced_config_map(LITELLM_CM, svc.ns)
    digest = entries.config_hash({"data": cm.data or {}})

    dep = client.AppsV1Api(svc.core.api_client).read_namespaced_deployment("litellm", svc.ns)
    pods = []
    for p in svc.core.list_namespaced_pod(svc.ns, label_selector="app.kubernetes.io/name=litellm").items:
        st = (p.status.container_statuses or [None])[0]
        waiting = st.state.waiting.reason if st is not None and st.state and st.state.waiting else None
        ready = bool(st is not None and st.ready)
        models = None
        if ready and p.status.pod_ip and p.metadata.deletion_timestamp is None:
            try:
                models = sorted(proxy_models(p))
            except Exception as exc:  # noqa: BLE001 - a description, not a check
                models = repr(exc)
        pods.append(f"{p.metadata.name} hash={(p.metadata.annotations or {}).get(LITELLM_HASH)} "
                    f"phase={p.status.phase} ready={ready} restarts={st.restart_count if st else None} "
                    f"waiting={waiting} deleting={p.metadata.deletion_timestamp is not None} models={models}")
    index = yaml.safe_load((cm.data or {}).get(LITELLM_INDEX, "{}") or "{}").get("include")
    return (f"ConfigMap hash {digest} (index {index}); Deployment hash "
            f"{(dep.spec.template.metadata.annotations or {}).get(LITELLM_HASH)}; pods: {pods}")


def proxy_models(pod) -> set[str]:
    status, body = call(f"http://{pod.status.pod_ip}:{LITELLM_PORT}", "/v1/models", None, headers=MASTER)
    assert status == 200, body
    return {m["id"] for m in json.loads(body)["data"]}


def set_litellm(svc, name: str, value) -> None:  # noqa: F811
    svc.co.patch_namespaced_custom_object(GROUP, VERSION, svc.ns, PLURAL, name, {"spec": {"litellm": value}})


@pytest.fixture(scope="module")
def proxy(kube, routed, svc, real):  # noqa: F811
    """The LiteLLM proxy as a pod, after the embedder and the reranker gained LiteLLM entries."""
    image = litellm_proxy.image()
    kube.import_images([image])
    set_litellm(svc, EMBED, {"configMapName": LITELLM_CM, "modelName": "minilm"})
    set_litellm(svc, RERANK, {"configMapName": LITELLM_CM, "modelName": "reranker"})

    def indexed():
        from kubernetes.client.rest import ApiException

        try:
            cm = svc.core.read_namespaced_config_map(LITELLM_CM, svc.ns)
        except ApiException as exc:  # not written yet: the operator creates it with the first entry
            if exc.status == 404:
                return None
            raise
        return cm if yaml.safe_load((cm.data or {}).get(LITELLM_INDEX, "{}") or "{}").get("include") == [
            f"embedops-{EMBED}.yaml", f"embedops-{RERANK}.yaml"] else None
    wait_for(indexed, timeout=60, what="both entries in the LiteLLM ConfigMap's index")
    kube.apply(litellm_manifests(svc.ns, image.ref, real.node_selector), namespace=svc.ns)
    t = time.monotonic()
    pod = wait_for(lambda: litellm_pod(svc), timeout=240, what="a ready LiteLLM pod")
    print(f"LiteLLM pod ready in {time.monotonic() - t:.0f}s")
    return pod


def test_litellm_in_the_cluster_serves_the_operators_entries(proxy, routed, svc):  # noqa: F811
    assert proxy_models(proxy) == {"minilm", "reranker"}
    url = f"http://{proxy.status.pod_ip}:{LITELLM_PORT}"
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=litellm_proxy.MASTER_KEY, timeout=60)
    via = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    status, body = call(backend(svc, EMBED), "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": TEXTS})
    want = [d["embedding"] for d in sorted(json.loads(body)["data"], key=lambda d: d["index"])]
    got = [d.embedding for d in sorted(via.data, key=lambda d: d.index)]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"OpenAI SDK -> LiteLLM pod -> Service: max |diff| to the server {worst:.1e}")
    assert len(got) == len(want) == 2 and worst < 1e-6
    status, body = call(url, "/rerank", {"model": "reranker", "query": QUERY, "documents": PASSAGES},
                        headers=MASTER)
    assert status == 200, body
    got = {r["index"]: r["relevance_score"] for r in json.loads(body)["results"]}
    _, direct = call(backend(svc, RERANK), "/rerank", {"query": QUERY, "texts": PASSAGES})
    want = {r["index"]: r["score"] for r in json.loads(direct)}
    print(f"LiteLLM /rerank (huggingface/ provider -> Service /rerank): {got}; the server: {want}")
    assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-6 for i in want)


def test_a_service_added_or_removed_reaches_the_running_proxy(proxy, routed, svc):  # noqa: F811
    """The operator rolls the labelled LiteLLM Deployment when its entries change: no hand edit, no restart
    by hand. Timed from the EmbeddingService change to a ready proxy pod that lists the new set."""
    from embedops_operator import litellm as entries

    for change, value, want in (("added", {"configMapName": LITELLM_CM, "modelName": "m3"},
                                 {"minilm", "reranker", "m3"}),
                                ("removed", None, {"minilm", "reranker"})):
        t = time.monotonic()
        set_litellm(svc, M3, value)

        def rolled():
            cm = svc.core.read_namespaced_config_map(LITELLM_CM, svc.ns)
            digest = entries.config_hash({"data": cm.data or {}})
            pod = litellm_pod(svc, digest)
            return (pod, digest) if pod is not None and proxy_models(pod) == want else None
        try:
            pod, digest = wait_for(rolled, timeout=300, what=f"a LiteLLM pod that lists {sorted(want)}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; at the end: {proxy_rollout(svc)}") from None
        from kubernetes import client

        dep = client.AppsV1Api(svc.core.api_client).read_namespaced_deployment("litellm", svc.ns)
        print(f"m3 {change}: a ready LiteLLM pod lists {sorted(want)} {time.monotonic() - t:.0f}s after the change "
              f"(pod template hash {digest})")
        assert dep.spec.template.metadata.annotations[LITELLM_HASH] == digest


# ---------------------------------------------------------------------------------------------- query time

QUERIES = ["Which currency is used in Japan?", "What is the capital of Kenya?", "What language do people speak in Brazil?",
           "Which continent is Peru in?", "Where do people pay with the forint?"]
RAG_TOOLS_IMAGE = "registry.example.com/rag-tools:py3-psycopg2"  # what ingest.yaml and query.yaml name


def job_output(svc, name: str, timeout: float) -> str:  # noqa: F811
    """The log of Job ``name``'s pod once the Job has succeeded; the log and the Job's status if it fails."""
    from kubernetes import client

    batch = client.BatchV1Api(svc.core.api_client)

    def finished():
        job = batch.read_namespaced_job(name, svc.ns)
        return job if (job.status.succeeded or 0) > 0 or (job.status.failed or 0) > 0 else None
    job = wait_for(finished, timeout=timeout, what=f"Job {name} finished")
    pods = svc.core.list_namespaced_pod(svc.ns, label_selector=f"job-name={name}").items
    logs = "\n".join(svc.core.read_namespaced_pod_log(p.metadata.name, svc.ns) or "" for p in pods)
    assert job.status.succeeded, f"Job {name} failed: {job.status}\n{logs[-4000:]}"
    return logs


def in_process_ranking(real, corpus: list[dict], queries: list[str], candidates: int) -> dict[str, dict]:
    """The same pattern computed here without any server: sentence-transformers embeds the corpus and the
    query, exact cosine search keeps ``candidates``, transformers' cross-encoder orders them."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = Path(real.models_hostpath)
    st = SentenceTransformer(str(root / MINILM), device="cpu")
    docs = st.encode([r["text"] for r in corpus], normalize_embeddings=True, convert_to_tensor=True)
    tok = AutoTokenizer.from_pretrained(str(root / RERANKER))
    ce = AutoModelForSequenceClassification.from_pretrained(str(root / RERANKER)).eval()
    out = {}
    for q in queries:
        qv = st.encode([q], normalize_embeddings=True, convert_to_tensor=True)
        near = torch.topk((docs @ qv.T).squeeze(1), candidates).indices.tolist()
        with torch.inference_mode():
            logits = ce(**tok([q] * len(near), [corpus[i]["text"] for i in near], padding=True, truncation=True,
                              max_length=256, return_tensors="pt")).logits[:, 0].tolist()
        order = sorted(range(len(near)), key=lambda k: -logits[k])
        out[q] = {"candidates": [corpus[i]["id"] for i in near], "ranked": [corpus[near[k]]["id"] for k in order],
                  "logits": [logits[k] for k in order]}
    return out


def test_the_query_time_pattern_end_to_end(kube, proxy, routed, gw, svc, real):  # noqa: F811
    """examples/query-time on real parts: PostgreSQL + pgvector as a pod, the ingestion Job embedding the corpus
    through the embedder's Service, then a query Job: LiteLLM (pod) -> embedder, pgvector HNSW search for 50
    candidates, the reranker through Traefik's route. The best passage must be the one sentence-transformers +
    transformers rank first in this process; each stage's latency is printed."""
    img = vector_store.image()
    kube.import_images([img])
    scripts = {f: (QUERY_TIME / f).read_text() for f in ("ingest.py", "query.py", "corpus.jsonl")}
    kube.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "query-time-scripts", "namespace": svc.ns},
                 "data": scripts}], namespace=svc.ns)
    local = {"pgvector/pgvector:pg17": img.ref, RAG_TOOLS_IMAGE: img.ref}
    kube.apply(example_manifests("pgvector.yaml", svc.ns, local, real.node_selector), namespace=svc.ns)
    t = time.monotonic()
    kube.apply(example_manifests("ingest.yaml", svc.ns, local, real.node_selector,
                                 env={"EMBED_URL": f"http://{EMBED}.{svc.ns}.svc.cluster.local"}), namespace=svc.ns)
    ingested = json.loads(job_output(svc, "ingest-corpus", timeout=300).strip().splitlines()[-1])
    corpus = [json.loads(line) for line in scripts["corpus.jsonl"].splitlines() if line.strip()]
    print(f"ingestion Job (Postgres starting beside it): {ingested}; {time.monotonic() - t:.0f}s from apply to done")
    assert ingested["rows"] == ingested["corpus"] == len(corpus) and ingested["dimension"] == 384, ingested

    kube.apply(example_manifests("query.yaml", svc.ns, local, real.node_selector, args=QUERIES, env={
        "LITELLM_URL": f"http://litellm.{svc.ns}.svc.cluster.local:{LITELLM_PORT}", "EMBED_MODEL": "minilm",
        "RERANK_URL": gw.in_cluster_url, "RERANK_HOST": RERANK_HOST}), namespace=svc.ns)
    answers = [json.loads(line) for line in job_output(svc, "query-once", timeout=240).splitlines()
               if line.startswith("{")]
    assert [a["query"] for a in answers] == QUERIES, answers

    want = in_process_ranking(real, corpus, QUERIES, candidates=50)
    stages = ("embed_via_litellm", "vector_search", "rerank_via_gateway", "total")
    print(f"{'query':44} {'top (pipeline)':24} {'top (in-process)':24} overlap " + " ".join(f"{s:>18}" for s in stages))
    for a in answers:
        w = want[a["query"]]
        overlap = len(set(a["candidates"]) & set(w["candidates"])) / len(w["candidates"])
        print(f"{a['query']:44} {a['kept'][0]:24} {w['ranked'][0]:24} {overlap:7.2f} "
              + " ".join(f"{a['latency_ms'][s]:16.1f}ms" for s in stages))
        assert len(a["candidates"]) == 50 and overlap >= 0.96, (a, w)
        # the tiny random reranker's logits sit close together: a candidate within float32 noise of the best
        # (ONNX Runtime in the pod, torch here) may come first instead
        tied = {i for i, logit in zip(w["ranked"], w["logits"]) if w["logits"][0] - logit < 1e-5}
        assert a["kept"][0] in tied, (a, w)
    # MiniLM itself finds the passage that answers each question among the candidates the reranker sees
    for a, gold in zip(answers, ("japan-currency", "kenya-capital", "brazil-language", "peru-continent",
                                 "hungary-currency")):
        assert gold in a["candidates"][:5], (gold, a["candidates"][:5])
    import statistics

    print("median latency (ms): " + ", ".join(
        f"{s} {statistics.median(a['latency_ms'][s] for a in answers):.1f}" for s in stages))


# ---------------------------------------------------------------------------------------------- API keys

SECURE, SECURE_KEY = "routed-secure", "sk-e2e-" + uuid.uuid4().hex[:12]


def test_a_protected_service_through_the_in_cluster_proxy(kube, proxy, routed, svc, real):  # noqa: F811
    """A service with apiKeySecretRef: its LiteLLM entry reads the key from the variable it names. Before the
    platform team gives the proxy that variable, a call through LiteLLM fails with 401 and the server's
    message (the other services keep answering); with it (from the same Secret), the call succeeds."""
    from kubernetes import client

    from embedops_operator import litellm as entries

    doc = on_real_node(example(), real)
    doc["metadata"]["name"] = SECURE
    doc["spec"]["apiKeySecretRef"] = {"name": "secure-key", "key": "api-key"}
    doc["spec"]["litellm"] = {"configMapName": LITELLM_CM, "modelName": "secure"}
    prerequisites(kube, svc.ns, [doc], host_path=real.models_hostpath)
    kube.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "secure-key", "namespace": svc.ns},
                 "stringData": {"api-key": SECURE_KEY}}], namespace=svc.ns)  # after prerequisites' stand-in key
    svc.create(doc)
    wait_ready(svc, SECURE, real)
    want = {"minilm", "reranker", "secure"}

    def rolled(env_name: str | None = None):
        cm = svc.core.read_namespaced_config_map(LITELLM_CM, svc.ns)
        pod = litellm_pod(svc, entries.config_hash({"data": cm.data or {}}))
        if pod is None or proxy_models(pod) != want:
            return None
        names = {e.name for c in pod.spec.containers for e in c.env or []}
        return pod if env_name is None or env_name in names else None
    pod = wait_for(rolled, timeout=300, what="a LiteLLM pod that lists the protected service")
    body = {"model": "secure", "input": TEXTS}
    status, answer = call(f"http://{pod.status.pod_ip}:{LITELLM_PORT}", "/v1/embeddings", body, headers=MASTER)
    # LiteLLM's OpenAI client refuses to send without a key: 500 naming the missing api_key and the model
    # group (the host test's reranker entry, huggingface/, sends and gets the server's 401 instead)
    print(f"without the key variable: {status} {answer[:300]!r}")
    assert status in (401, 500) and b"api_key" in answer and b"'secure'" in answer, (status, answer)
    assert call(f"http://{pod.status.pod_ip}:{LITELLM_PORT}", "/v1/embeddings", {"model": "minilm", "input": TEXTS},
                headers=MASTER)[0] == 200

    entry = yaml.safe_load(svc.core.read_namespaced_config_map(LITELLM_CM, svc.ns).data[f"embedops-{SECURE}.yaml"])
    env_name = entry["model_list"][0]["litellm_params"]["api_key"].removeprefix("os.environ/")
    apps = client.AppsV1Api(svc.core.api_client)
    apps.patch_namespaced_deployment("litellm", svc.ns, {"spec": {"template": {"spec": {"containers": [{
        "name": "litellm", "env": [{"name": env_name, "valueFrom": {
            "secretKeyRef": {"name": "secure-key", "key": "api-key"}}}]}]}}}})
    pod = wait_for(lambda: rolled(env_name), timeout=300, what=f"a LiteLLM pod with {env_name}")
    status, answer = call(f"http://{pod.status.pod_ip}:{LITELLM_PORT}", "/v1/embeddings", body, headers=MASTER)
    assert status == 200, answer
    direct = call(backend(svc, SECURE), "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": TEXTS},
                  headers={"Authorization": f"Bearer {SECURE_KEY}"})
    assert direct[0] == 200, direct
    assert call(backend(svc, SECURE), "/v1/embeddings", body)[0] == 401
    got = [d["embedding"] for d in sorted(json.loads(answer)["data"], key=lambda d: d["index"])]
    ref = [d["embedding"] for d in sorted(json.loads(direct[1])["data"], key=lambda d: d["index"])]
    worst = max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g, r))
    print(f"with {env_name} from the Secret: 200, max |diff| to the server {worst:.1e}")
    assert worst < 1e-6
    # what the proxy hop costs a one-query embedding, side by side (sequential calls from this machine)
    import statistics

    def median_ms(base: str, path: str, payload: dict, headers: dict) -> float:
        times = []
        for _ in range(30):
            t = time.perf_counter()
            assert call(base, path, payload, headers=headers)[0] == 200
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    one = {"input": ["Which currency is used in Japan?"]}
    via = median_ms(f"http://{pod.status.pod_ip}:{LITELLM_PORT}", "/v1/embeddings", {**one, "model": "secure"}, MASTER)
    straight = median_ms(backend(svc, SECURE), "/v1/embeddings", {**one, "model": "all-MiniLM-L6-v2"},
                         {"Authorization": f"Bearer {SECURE_KEY}"})
    print(f"one-query /v1/embeddings, median of 30: through LiteLLM {via:.1f} ms, straight to the pod {straight:.1f} ms "
          f"({via / straight:.1f}x)")
