"""The serving path end to end: the operator's rendered server configuration, run for real.

The operator reconciles two CPU EmbeddingServices on the cluster (the examples' MiniLM ingestion
embedder and a reranker); the test reads each reconciled Deployment's server container (command, args,
env, volume mounts), runs exactly that as a local process on the bundled models (localcluster/models.py
minilm_dir(), and a tiny random cross-encoder) and calls /v1/embeddings and /rerank on it.
"""
from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, operator_log, skip_unless_simulated_nodes
from localcluster.local_server import LocalServer, local_command, secret_reader
from localcluster.pki import free_port
from localcluster.models import make_tiny_reranker
from localcluster.workloads import prerequisites

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RERANKER = {
    "apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService", "metadata": {"name": "tiny-reranker"},
    "spec": {"model": {"id": "/models/tiny-reranker", "task": "rerank", "maxInputLength": 256,
                       "source": {"pvc": {"claimName": "embedops-models"}}},
             "accelerator": {"cpu": {"cores": 2, "memory": "2Gi"}},
             "batching": {"maxBatchTokens": 4096},
             "replicas": 1},
}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from localcluster.models import minilm_dir

    try:
        minilm = minilm_dir()
    except RuntimeError as e:
        pytest.skip(str(e))
    d = tmp_path_factory.mktemp("models")
    (d / "all-MiniLM-L6-v2").symlink_to(minilm)
    make_tiny_reranker(d / "tiny-reranker", minilm)
    return d


def _run_reconciled(embsvc, kube, name, models_dir, tmp_path):
    try:
        embsvc.wait_condition(name, "Ready", timeout=120)
    except AssertionError:
        pytest.fail(f"{name} never Ready: {embsvc.get(name).get('status')}")
    dep = embsvc.apps.api_client.sanitize_for_serialization(embsvc.deployment(name))
    pvc_volumes = {v["name"] for v in dep["spec"]["template"]["spec"].get("volumes") or []
                   if (v.get("persistentVolumeClaim") or {}).get("claimName") == "embedops-models"}
    assert pvc_volumes, "the model PVC is not mounted"
    port = free_port()
    argv, env = local_command(dep, volume_dirs={v: models_dir for v in pvc_volumes}, scratch=tmp_path / "vol",
                              port=port, secrets=secret_reader(embsvc.core, embsvc.ns))
    srv = LocalServer(argv, env, tmp_path / f"{name}.log", port).start()
    try:
        srv.wait_healthy(timeout=300)
    except Exception:
        srv.stop()
        raise
    return srv, dep


def test_embeddings_through_the_rendered_server_command(kube, embsvc, namespace, operator, models_dir, tmp_path):
    skip_unless_simulated_nodes(kube)  # the example must be Ready at its production size first
    doc = yaml.safe_load((REPO / "examples" / "cpu-ingestion.yaml").read_text())
    prerequisites(kube, namespace, [doc])
    embsvc.create(doc)
    name = doc["metadata"]["name"]
    srv, dep = _run_reconciled(embsvc, kube, name, models_dir, tmp_path)
    try:
        served = doc["spec"]["model"].get("servedModelName") or name
        out = post(srv.url + "/v1/embeddings", {"model": served, "input": [
            "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]})
        vecs = [d["embedding"] for d in sorted(out["data"], key=lambda d: d["index"])]
        assert len(vecs) == 3 and all(len(v) == 384 for v in vecs)
        assert out.get("model") == served
        assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2]) + 0.2
        # TEI's native route on the same process
        tei = post(srv.url + "/embed", {"inputs": "hello world"})
        assert len(tei) == 1 and len(tei[0]) == 384
    except Exception:
        print(srv.tail())
        print(operator_log(operator))
        raise
    finally:
        srv.stop()


def test_rerank_through_the_rendered_server_command(kube, embsvc, namespace, operator, models_dir, tmp_path):
    skip_unless_simulated_nodes(kube)
    prerequisites(kube, namespace, [RERANKER])
    embsvc.create(RERANKER)
    srv, dep = _run_reconciled(embsvc, kube, "tiny-reranker", models_dir, tmp_path)
    try:
        texts = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris."]
        out = post(srv.url + "/rerank", {"query": "Where is the Eiffel Tower?", "texts": texts})
        assert sorted(r["index"] for r in out) == [0, 1, 2]
        assert all(isinstance(r["score"], float) for r in out)
        scores = [r["score"] for r in out]
        assert scores == sorted(scores, reverse=True)
    except Exception:
        print(srv.tail())
        raise
    finally:
        srv.stop()
    assert Path(dep["spec"]["template"]["spec"]["containers"][0]["command"][0]).name == "embedops-server"
