"""examples/query-time stays consistent with itself and with the operator: the services validate and render
the routes and LiteLLM entries the scripts call, the reranker admits the candidates query.py sends, and the
kustomization lists files that exist. (tests/e2e/test_gateway_and_litellm.py runs the example on real pods.)"""
from __future__ import annotations

import ast
import json

import yaml

from embedops_operator import render as R
from embedops_operator.validate import defaulted, validate
from tests.unit.operator_helpers import EXAMPLES, by_kind

FOLDER = EXAMPLES / "query-time"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((FOLDER / name).read_text()) if d]


def env_of(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def default_of(script: str, name: str) -> str:
    """The default of ``int(os.environ.get(name, "<default>"))`` in one of the example's scripts."""
    for node in ast.walk(ast.parse((FOLDER / script).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == name:
            return node.args[1].value
    raise AssertionError(f"{name} not read in {script}")


def test_services_validate_render_and_fit_what_the_scripts_send():
    services = {d["metadata"]["name"]: d for d in docs("services.yaml")}
    assert set(services) == {"embedder", "reranker"}
    for d in services.values():
        assert validate(d) == [], d["metadata"]["name"]
    reranker = by_kind(R.render(defaulted(services["reranker"])))
    paths = [r["matches"][0]["path"]["value"] for r in reranker["HTTPRoute"]["spec"]["rules"]]
    assert "/rerank" in paths
    candidates = int(env_of(docs("query.yaml")[0]).get("CANDIDATES") or default_of("query.py", "CANDIDATES"))
    assert services["reranker"]["spec"]["batching"]["maxClientBatchSize"] >= candidates
    embedder = by_kind(R.render(defaulted(services["embedder"])))
    entry = yaml.safe_load(next(iter(embedder["ConfigMap"]["data"].values())))
    assert entry["model_list"][0]["model_name"] == env_of(docs("query.yaml")[0])["EMBED_MODEL"]
    # the ingestion Job calls the embedder's Service by its in-cluster name in the kustomization's namespace
    ns = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())["namespace"]
    assert env_of(docs("ingest.yaml")[0])["EMBED_URL"] == f"http://embedder.{ns}.svc.cluster.local"
    host = services["reranker"]["spec"]["gateway"]["hostnames"][0]
    assert env_of(docs("query.yaml")[0])["RERANK_URL"].removeprefix("http://").split(":")[0].split("/")[0] == host
    assert int(default_of("ingest.py", "BATCH")) <= services["embedder"]["spec"]["batching"]["maxClientBatchSize"]


def test_litellm_deployment_consumes_the_configmap_the_services_write():
    services = docs("services.yaml")
    cms = {d["spec"]["litellm"]["configMapName"] for d in services}
    litellm = {d["kind"]: d for d in docs("litellm.yaml")}
    dep = litellm["Deployment"]
    assert dep["metadata"]["labels"]["embedops.dev/litellm-config"] in cms
    mounted = {v["configMap"]["name"] for v in dep["spec"]["template"]["spec"]["volumes"] if "configMap" in v}
    assert cms <= mounted
    config = yaml.safe_load(litellm["ConfigMap"]["data"]["config.yaml"])
    assert config["include"] == ["/etc/litellm-embedops/embedops.yaml"]


def test_kustomization_lists_existing_files_and_the_corpus_is_well_formed():
    kust = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())
    files = kust["resources"] + [f for g in kust["configMapGenerator"] for f in g["files"]]
    assert all((FOLDER / f).is_file() for f in files), files
    rows = [json.loads(line) for line in (FOLDER / "corpus.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows) >= 100 and all(r["text"].strip() for r in rows)


def test_the_gateway_example_is_the_local_clusters_gateway():
    """What the e2e test's routes attach to (localcluster/gateway.py) is what the example tells users to apply,
    and the services' parentRefs name it."""
    from localcluster import gateway

    local = {d["kind"]: d for d in gateway.manifests("image", {}) if d["kind"] in ("GatewayClass", "Gateway")}
    assert {d["kind"]: d for d in docs("gateway.yaml")} == local
    for d in docs("services.yaml"):
        assert d["spec"]["gateway"]["parentRefs"] == [gateway.PARENT_REF]
