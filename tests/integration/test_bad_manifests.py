"""Bad manifests in bulk (issue 35, point 6): a property-based campaign of generated EmbeddingServices against the
real API server and the running operator (a real process, cluster-wide, the chart's RBAC).

Each generated manifest is either refused by the API server with a message (schema, CEL) or accepted; an accepted
one must be reconciled (status.observedGeneration reaches its generation) within a bound, whatever its conditions
say. Across the campaign the operator never exits, never writes an object outside the manifest's namespace or
outside its name (every object it wrote is named after the EmbeddingService, or is the LiteLLM ConfigMap the
manifest names), and stops writing once the services are gone (no loop). The counts are printed.

Seeded (derandomize): the same manifests every run, so a failure reproduces; `EMBEDOPS_FUZZ_EXAMPLES` sets how
many (default 200).
"""
from __future__ import annotations

import collections
import json
import os
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.integration.operator_process import GROUP, PLURAL, VERSION, OperatorProcess, es_body, operator_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]
EXAMPLES = int(os.environ.get("EMBEDOPS_FUZZ_EXAMPLES", "200"))
RECONCILE_WITHIN = 45.0

ids = st.sampled_from(["BAAI/bge-small-en-v1.5", "/models/all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2",
                       "acme/reranker-x", "naver/splade-v3", "BAAI/bge-m3", "x", "", "a b", "$(reboot)", "`id`",
                       "../../etc/passwd", "org/name/extra", "a" * 600, "/models/a;rm -rf /", "-rf", "é/ü"])
quantities = st.one_of(st.sampled_from(["1Gi", "512Mi", "2", "0", "-1", "1.5Gi", "lots", "100m", "64Gi", "1e3"]),
                       st.text(max_size=6))
small_ints = st.one_of(st.integers(-3, 10), st.sampled_from([0, 1, 2, 7, 8, 1000, 10 ** 9]))
cpu = st.fixed_dictionaries({}, optional={"cores": small_ints, "memory": quantities,
                                          "instructionSets": st.lists(st.sampled_from(
                                              ["avx2", "amx_int8", "sse9", "avx512_vnni"]), max_size=3)})
mig = st.fixed_dictionaries({"profile": st.sampled_from(["1g.10gb", "1g.18gb", "7g.80gb", "9g.9gb"])},
                            optional={"product": st.sampled_from(["H100-80GB", "H200-141GB", "A30-24GB", "B200"]),
                                      "count": small_ints, "strategy": st.sampled_from(["mixed", "single", "x"])})
gpu = st.fixed_dictionaries({}, optional={"count": small_ints, "product": st.sampled_from(["NVIDIA-L4", ""])})
accelerators = st.one_of(st.builds(lambda c: {"cpu": c}, cpu), st.builds(lambda m: {"mig": m}, mig),
                         st.builds(lambda g: {"gpu": g}, gpu), st.just({}),
                         st.builds(lambda c, m: {"cpu": c, "mig": m}, cpu, mig), st.just({"tpu": {}}))
model = st.fixed_dictionaries({"id": ids}, optional={
    "task": st.sampled_from(["embed", "rerank", "classify", "sparse", "generate"]),
    "pooling": st.sampled_from(["cls", "mean", "splade", "last-token", "max"]),
    "dtype": st.sampled_from(["float16", "float32", "bfloat16", "int4"]),
    "quantize": st.sampled_from(["int8", "int4"]), "maxInputLength": small_ints,
    "revision": st.sampled_from(["main", "5617a9f61b028005a4858fdac845db406aefb181", "$(x)"]),
    "outputs": st.lists(st.sampled_from(["dense", "sparse", "colbert", "other"]), max_size=4),
    "prompts": st.fixed_dictionaries({}, optional={"defaultPromptName": st.sampled_from(["query", ""]),
                                                   "defaultPrompt": st.text(max_size=10)}),
    "source": st.one_of(st.just({"pvc": {"claimName": "models"}}), st.just({"download": {"cacheSize": "3Gi"}}),
                        st.just({"pvc": {}}), st.just({"download": {"cacheSize": "huge"}}))})
# what a careful author writes, with the combinations CEL still refuses (a gateway without a key, int8 on a GPU)
valid_specs = st.fixed_dictionaries({
    "model": st.fixed_dictionaries({"id": st.sampled_from(["BAAI/bge-small-en-v1.5", "/models/all-MiniLM-L6-v2",
                                                            "acme/reranker-x", "naver/splade-v3"])}, optional={
        "pooling": st.sampled_from(["cls", "mean"]), "maxInputLength": st.sampled_from([128, 256, 512]),
        "quantize": st.just("int8"), "source": st.just({"pvc": {"claimName": "models"}})}),
    "accelerator": st.one_of(st.just({"cpu": {"cores": 1, "memory": "2Gi"}}),
                             st.just({"mig": {"profile": "1g.10gb"}}), st.just({"gpu": {"count": 1}}))}, optional={
    "replicas": st.integers(0, 4),
    "autoscaling": st.fixed_dictionaries({"maxReplicas": st.integers(1, 4)}, optional={
        "minReplicas": st.integers(0, 2), "provider": st.sampled_from(["auto", "keda", "hpa"])}),
    "gateway": st.fixed_dictionaries({"parentRefs": st.just([{"name": "gw"}])},
                                     optional={"allowUnauthenticated": st.booleans()}),
    "apiKeySecretRef": st.just({"name": "key"}),
    "litellm": st.just({"configMapName": "litellm"}),
    "migration": st.fixed_dictionaries({}, optional={"promotion": st.sampled_from(["Manual", "Immediate"])}),
    "monitoring": st.just({"serviceMonitor": {"enabled": False}}),
})
chaos_specs = st.fixed_dictionaries({"model": model, "accelerator": accelerators}, optional={
    "replicas": small_ints,
    "batching": st.fixed_dictionaries({}, optional={"maxBatchTokens": small_ints, "maxClientBatchSize": small_ints,
                                                    "maxConcurrentRequests": small_ints}),
    "autoscaling": st.fixed_dictionaries({"maxReplicas": small_ints}, optional={
        "minReplicas": small_ints, "provider": st.sampled_from(["auto", "keda", "hpa", "x"]),
        "prometheusAddress": st.sampled_from(["http://prometheus:9090", "file:///etc/shadow", ""])}),
    "service": st.fixed_dictionaries({}, optional={"type": st.sampled_from(["ClusterIP", "LoadBalancer", "Headless"]),
                                                   "port": st.integers(-1, 70000)}),
    "gateway": st.fixed_dictionaries({"parentRefs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(
        ["gw", ""])}), max_size=2)}, optional={"hostnames": st.lists(st.sampled_from(["a.example.com", "*"]),
                                                                     max_size=2),
                                               "pathPrefix": st.sampled_from(["/x", "x", "/a b", ""]),
                                               "allowUnauthenticated": st.booleans()}),
    "apiKeySecretRef": st.sampled_from([{"name": "key"}, {"name": ""}, {}]),
    "litellm": st.fixed_dictionaries({"configMapName": st.sampled_from(["litellm", "", "kube-root-ca.crt"])}),
    "migration": st.fixed_dictionaries({}, optional={
        "promotion": st.sampled_from(["Manual", "Immediate", "AfterReindex", "Never"]),
        "promote": st.sampled_from(["deadbeef", "nothex!!", ""]), "keepPreviousSeconds": small_ints}),
    "drainSeconds": small_ints,
    "env": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["A", "API_KEY", ""]),
                                           "value": st.text(max_size=5)}), max_size=2),
    "tolerations": st.lists(st.sampled_from([{"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"},
                                             {"key": 5}]), max_size=2),
    "resources": st.sampled_from([{"limits": {"memory": "1Gi"}}, {"limits": {"memory": "lots"}}, {"requests": 3}]),
    "nodeSelector": st.dictionaries(st.sampled_from(["a", "kubernetes.io/hostname", "bad key!"]), st.text(max_size=4),
                                    max_size=2),
    "podAnnotations": st.dictionaries(st.sampled_from(["a", "x/y"]), st.text(max_size=4), max_size=2),
    "image": st.sampled_from(["registry/x:1", "", "UPPER/Case"]),
})
specs = st.one_of(valid_specs, valid_specs, chaos_specs)


@pytest.fixture(scope="module")
def env(kube, tmp_path_factory):
    if not kube.helm:
        pytest.skip("helm not available (make cluster-binaries): the operator runs with the chart's RBAC")
    with operator_env(kube, tmp_path_factory.mktemp("fuzz"), "fuzz", chart_rbac=True) as e:
        e.op = OperatorProcess("fuzz", e.kubeconfig, e.tmp, ["-n", e.ns, "--resync-seconds=5"]).start()
        e.procs.append(e.op)
        e.refused, e.reconciled, e.names = collections.Counter(), collections.Counter(), {}
        yield e


def run_one(env, name: str, spec: dict) -> None:
    from kubernetes.client.rest import ApiException

    try:
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, name, spec))
    except ApiException as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.body)
        msg = json.loads(exc.body).get("message") or ""
        assert msg, exc.body  # refused with a message, never silently
        # the category: the first field or rule the message names
        env.refused[re.sub(r"[\d\"']", "", msg.split(": ", 2)[-1])[:70]] += 1
        return
    env.names[name] = spec
    deadline = time.monotonic() + RECONCILE_WITHIN
    while True:
        assert env.op.alive(), f"the operator exited on {json.dumps(spec)}:\n{env.op.log()[-4000:]}"
        es = env.custom.get_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)
        st_ = es.get("status") or {}
        if st_.get("observedGeneration") == es["metadata"]["generation"]:
            conds = {c["type"]: c for c in st_.get("conditions") or []}
            ready = conds.get("Ready") or {}
            env.reconciled[f"Ready={ready.get('status')}/{ready.get('reason')}"] += 1
            break
        assert time.monotonic() < deadline, f"not reconciled within {RECONCILE_WITHIN} s: {json.dumps(spec)}"
        time.sleep(0.2)
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)


def test_every_generated_manifest_is_refused_with_a_message_or_reconciled(env, kube):
    counter = iter(range(10 ** 6))

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(spec=specs)
    def campaign(spec):
        run_one(env, f"fz-{next(counter)}", spec)

    started = time.monotonic()
    campaign()
    took = time.monotonic() - started
    # the operator quiets down once the services are gone: no reconcile loop
    time.sleep(8)
    tail = env.op.log().splitlines()
    time.sleep(10)
    later = env.op.log().splitlines()[len(tail):]
    applied = [line for line in later if ": applied " in line]
    assert not applied, applied[:10]
    assert env.op.alive(), env.op.log()[-3000:]
    # nothing written outside the manifest's namespace or name (its children are named after it; the LiteLLM
    # ConfigMap is the one the manifest names)
    written = re.findall(r" (\S+)/(fz-\d+): applied \[(.*?)\], pruned", env.op.log())
    assert written, "the operator applied nothing: the campaign exercised no reconcile"
    for ns, name, items in written:
        assert ns == env.ns
        cm = ((env.names[name].get("litellm") or {}).get("configMapName"))
        for item in re.findall(r"'([^']+)'", items):
            kind, obj = item.split(" ")[0].split("/", 1)
            assert obj.startswith(name) or (kind == "ConfigMap" and obj == cm), (name, item)
    total = sum(env.refused.values()) + sum(env.reconciled.values())
    print(f"\nbad-manifest campaign: {total} manifests in {took:.0f} s; refused by the API server "
          f"{sum(env.refused.values())}, reconciled {sum(env.reconciled.values())}; operator restarts 0; "
          f"objects the operator wrote: {sum(len(re.findall(chr(39) + '[^' + chr(39) + ']+' + chr(39), i)) for _, _, i in written)}")
    print("refused, by message:\n  " + "\n  ".join(f"{n:3d}  {m}" for m, n in env.refused.most_common(25)))
    print("reconciled, by Ready condition:\n  " + "\n  ".join(f"{n:3d}  {m}" for m, n in env.reconciled.most_common()))
    assert sum(env.reconciled.values()) >= 5 and sum(env.refused.values()) >= 5  # both sides exercised
