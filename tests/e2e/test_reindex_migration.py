"""A model change with its reindex, on PostgreSQL + pgvector (issue 36): every query sent during the whole migration
is answered from one consistent space.

On the real node: the query-time example's pgvector and ingestion (examples/query-time/ingest.py: one table per
embedding space, `passages_<space>`), all-MiniLM-L6-v2 (mean pooling) ingested, then `model.pooling: cls` with
`migration.promotion: AfterReindex` and the example's ingestion Job as the reindex template. A probe sends the five
example questions in turn, every 100 ms, to the service's address: it embeds each, reads the space from the answer's
`embedding-space` header and searches that space's table exactly (no index). The operator brings the new space up
beside the old one, runs the reindex Job against it (the space's address and fingerprint in its environment), and
promotes when the Job succeeds. For every answer the probe got, the ten nearest passages must equal an exact search
done in this process with sentence-transformers in the space that answered (overlap 1.00); no query fails.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from localcluster import vector_store
from localcluster.models import MINILM
from localcluster.workloads import prerequisites
from tests.e2e.conftest import GROUP, PLURAL, VERSION, wait_for
from tests.e2e.real_pods import client_pod, exec_in, pod_log, wait_pod_phase
from tests.e2e.test_gateway_and_litellm import QUERIES, QUERY_TIME, RAG_TOOLS_IMAGE, example_manifests, job_output
from tests.e2e.test_real_pods import (_kubeconfig, example, kubectl, ns, on_real_node, real,  # noqa: F401
                                      service_url, svc, wait_ready)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]
NAME = "rag-embedder"
PG_PASSWORD = "change-me-rag-demo"  # examples/query-time/pgvector.yaml's Secret
TOP = 10

# Every $PERIOD s: the next of $QUERIES embedded at $URL (its answer names the space), then an exact search of that
# space's table; one line per query: [time, query, space, the TOP nearest ids] (ids: an error's text when it failed).
PROBE = r"""
import json, os, time, urllib.request, psycopg2
url, queries, period, top = os.environ["URL"], json.loads(os.environ["QUERIES"]), float(os.environ["PERIOD"]), int(os.environ["TOP"])
conn = psycopg2.connect("")
conn.autocommit = True
cur = conn.cursor()
cur.execute("SET enable_indexscan = off")  # an exact search: the HNSW index is approximate
print("started", flush=True)
t0, i = time.time(), 0
while not os.path.exists("/tmp/stop") and time.time() - t0 < float(os.environ["MAX_SECONDS"]):
    t, q = time.time(), queries[i % len(queries)]
    i += 1
    try:
        req = urllib.request.Request(url + "/embed", data=json.dumps({"inputs": [q]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            space, v = r.headers.get("embedding-space"), json.loads(r.read())[0]
        cur.execute(f"SELECT id FROM passages_{space} ORDER BY embedding <=> %s::vector LIMIT {top}", (json.dumps(v),))
        print(json.dumps([round(t, 3), q, space, [row[0] for row in cur.fetchall()]]), flush=True)
    except Exception as e:
        print(json.dumps([round(t, 3), q, None, f"{type(e).__name__}: {e}"[:300]]), flush=True)
    time.sleep(max(0.0, period - (time.time() - t)))
"""


def in_process(real, corpus: list[dict], queries: list[str], pooling: str) -> dict[str, set]:
    """The TOP nearest passage ids of each query in one space, computed here: sentence-transformers with the space's
    pooling over the same folder, normalized, exact cosine search."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    folder = str(Path(real.models_hostpath) / MINILM)
    word = models.Transformer(folder, max_seq_length=256)
    st = SentenceTransformer(modules=[word, models.Pooling(word.get_word_embedding_dimension(), pooling_mode=pooling),
                                      models.Normalize()], device="cpu")
    docs = st.encode([r["text"] for r in corpus], convert_to_tensor=True)
    out = {}
    for q in queries:
        qv = st.encode([q], convert_to_tensor=True)
        near = torch.topk((docs @ qv.T).squeeze(1), TOP).indices.tolist()
        out[q] = {corpus[i]["id"] for i in near}
    return out


def spaces(svc) -> dict:
    return {x["role"]: x for x in (svc.get(NAME).get("status") or {}).get("spaces") or []}


def test_a_reindexed_migration_answers_every_query_from_one_consistent_space(kube, real, ns, svc):
    img = vector_store.image()
    kube.import_images([img])
    scripts = {f: (QUERY_TIME / f).read_text() for f in ("ingest.py", "query.py", "corpus.jsonl")}
    kube.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "query-time-scripts", "namespace": ns},
                 "data": scripts}], namespace=ns)
    local = {"pgvector/pgvector:pg17": img.ref, RAG_TOOLS_IMAGE: img.ref}
    kube.apply(example_manifests("pgvector.yaml", ns, local, real.node_selector), namespace=ns)
    stable = service_url(NAME, ns)
    (ingest,) = example_manifests("ingest.yaml", ns, local, real.node_selector, env={"EMBED_URL": stable})
    doc = on_real_node(example(), real)
    doc["metadata"]["name"] = NAME
    doc["spec"]["accelerator"]["cpu"]["memory"] = "1Gi"
    # the reindex: the example's own ingestion, which the operator runs against the new space's address
    doc["spec"]["migration"] = {"promotion": "AfterReindex", "reindex": {"template": ingest["spec"]["template"]}}
    prerequisites(kube, ns, [doc], host_path=real.models_hostpath)
    svc.create(doc)
    wait_ready(svc, NAME, real)
    kube.apply([ingest], namespace=ns)
    first = json.loads(job_output(svc, "ingest-corpus", timeout=300).strip().splitlines()[-1])
    old = spaces(svc)["serving"]
    assert first["space"] == old["fingerprint"] and first["table"] == f"passages_{old['fingerprint']}", (first, old)

    probe = "reindex-probe"
    svc.core.create_namespaced_pod(ns, client_pod(probe, img.ref, PROBE, real.node_selector, {
        "URL": stable, "QUERIES": json.dumps(QUERIES), "PERIOD": 0.1, "TOP": TOP, "MAX_SECONDS": 600,
        "PGHOST": "pgvector", "PGUSER": "postgres", "PGDATABASE": "postgres", "PGPASSWORD": PG_PASSWORD}))
    wait_for(lambda: len(pod_log(svc.core, ns, probe).splitlines()) > 10, timeout=120, what="probe answering")
    changed = time.time()
    svc.co.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, NAME, {"spec": {"model": {"pooling": "cls"}}})

    def promoted():
        e = svc.get(NAME)
        cond = {c["type"]: c for c in (e.get("status") or {}).get("conditions") or []}.get("Promoted") or {}
        return e if cond.get("status") == "True" and e["status"]["observedGeneration"] == e["metadata"]["generation"] \
            else None
    wait_for(promoted, timeout=400, what="the new space promoted after its reindex Job")
    took = time.time() - changed
    new = spaces(svc)["serving"]
    print(kubectl("get", "embsvc", NAME, "-n", ns, "-o", "wide"))
    time.sleep(5)
    exec_in(kube, ns, probe, ["python3", "-c", "open('/tmp/stop', 'w').close()"])
    wait_pod_phase(svc.core, ns, probe, ("Succeeded",), timeout=60)
    answers = [json.loads(x) for x in svc.core.read_namespaced_pod_log(probe, ns).splitlines() if x.startswith("[")]
    svc.core.delete_namespaced_pod(probe, ns, grace_period_seconds=0)
    jobs = [j.metadata.name for j in __import__("kubernetes").client.BatchV1Api(svc.core.api_client)
            .list_namespaced_job(ns).items]

    corpus = [json.loads(line) for line in scripts["corpus.jsonl"].splitlines() if line.strip()]
    expected = {old["fingerprint"]: in_process(real, corpus, QUERIES, "mean"),
                new["fingerprint"]: in_process(real, corpus, QUERIES, "cls")}
    failed = [a for a in answers if a[2] is None]
    by_space: dict = {}
    mismatched = []
    for t, q, space, ids in answers:
        if space is None:
            continue
        by_space[space] = by_space.get(space, 0) + 1
        if set(ids) != expected[space][q]:
            mismatched.append((round(t - changed, 2), q, space, sorted(set(ids) ^ expected[space][q])))
    switches = [i for i in range(1, len(answers)) if answers[i][2] != answers[i - 1][2]]
    summary = {"answers": len(answers), "failed": len(failed), "by_space": by_space, "mismatched": len(mismatched),
               "space_switches": len(switches), "promoted_after_s": round(took, 1), "jobs": jobs,
               "old": old["fingerprint"], "new": new["fingerprint"]}
    print(f"reindexed migration on pgvector: {json.dumps(summary)}")
    assert not failed, failed[:5]
    assert old["fingerprint"] != new["fingerprint"] and set(by_space) == {old["fingerprint"], new["fingerprint"]}
    assert len(switches) == 1, [answers[i - 1:i + 1] for i in switches][:6]  # old, then new: never back
    assert not mismatched, mismatched[:5]  # overlap 1.00 for every query in the space that answered it
    assert any(j.startswith(f"{NAME}-reindex-{new['key']}-") for j in jobs), jobs
    svc.delete(NAME)
