"""Validation messages: the CEL rules and schema checks the API server enforces (evaluated offline)."""
from __future__ import annotations

import copy

import pytest

from embedops_operator import spec as S
from embedops_operator.validate import defaulted, validate
from tests.unit.operator_helpers import CPU, MIG, es


def errors_of(spec: dict) -> list[str]:
    return validate(es(spec))


def with_(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for dotted, value in changes.items():
        node = out
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return out


def test_valid_specs_have_no_errors():
    assert errors_of(MIG) == []
    assert errors_of(CPU) == []


@pytest.mark.parametrize("accelerator", [{}, {"mig": {"profile": "1g.10gb"}, "cpu": {}},
                                         {"gpu": {}, "cpu": {}}])
def test_exactly_one_accelerator(accelerator):
    errs = errors_of(with_(MIG, accelerator=accelerator))
    assert any("accelerator: set exactly one of mig, gpu or cpu" in e for e in errs), errs


@pytest.mark.parametrize("product", sorted(S.MIG_PROFILES))
def test_every_published_profile_is_accepted(product):
    for profile in S.MIG_PROFILES[product]:
        assert errors_of(with_(MIG, accelerator={"mig": {"product": product, "profile": profile}})) == []


def test_profile_of_another_gpu_is_refused_with_the_valid_list():
    errs = errors_of(with_(MIG, accelerator={"mig": {"product": "H200-141GB", "profile": "1g.10gb"}}))
    assert errs == ["spec.accelerator.mig.profile: Invalid value: MIG profile 1g.10gb is not offered by "
                    "H200-141GB; valid: 1g.18gb, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb"]
    # default product is H100-80GB
    errs = errors_of(with_(MIG, accelerator={"mig": {"profile": "1g.18gb"}}))
    assert "not offered by H100-80GB" in errs[0]


def test_unknown_profile_is_an_enum_error():
    errs = errors_of(with_(MIG, accelerator={"mig": {"profile": "1g.99gb"}}))
    assert any("Unsupported value: '1g.99gb'" in e for e in errs)


def test_token_budget_must_cover_longest_input():
    spec = with_(MIG, model__maxInputLength=8192, batching={"maxBatchTokens": 4096})
    assert errors_of(spec) == ["spec: Invalid value: batching.maxBatchTokens must be at least "
                               "model.maxInputLength (the longest accepted input)"]
    # the default budget (16384) covers 8192
    assert errors_of(with_(MIG, model__maxInputLength=8192)) == []
    assert errors_of(with_(MIG, model__maxInputLength=20000))  # default budget too small


def test_float16_refused_on_cpu():
    errs = errors_of(with_(CPU, model__dtype="float16"))
    assert errs == ["spec: Invalid value: model.dtype float16 is not supported on CPU; use float32 or bfloat16"]


def test_int8_only_on_cpu_in_float32():
    assert errors_of(with_(CPU, model__quantize="int8")) == []
    assert errors_of(with_(MIG, model__quantize="int8")) == [
        "spec: Invalid value: model.quantize int8 runs on CPU (ONNX Runtime); GPU and MIG serve float16 or bfloat16"]
    assert errors_of(with_(CPU, model__quantize="int8", model__dtype="bfloat16")) == [
        "spec: Invalid value: model.quantize int8 needs model.dtype float32 (or unset)"]
    assert any("Unsupported value: 'int4'" in e for e in errors_of(with_(CPU, model__quantize="int4")))


def test_autoscaling_bounds():
    errs = errors_of(with_(MIG, autoscaling={"minReplicas": 5, "maxReplicas": 2}))
    assert "autoscaling: minReplicas must not exceed maxReplicas" in errs[0]
    errs = errors_of(with_(MIG, autoscaling={"minReplicas": 0, "maxReplicas": 2, "provider": "hpa"}))
    assert any("scale to zero" in e for e in errs)
    assert any("maxReplicas: Required value" in e for e in errors_of(with_(MIG, autoscaling={})))


def test_model_rules():
    assert any("pooling does not apply to rerank" in e
               for e in errors_of(with_(MIG, model={"id": "x", "task": "rerank", "pooling": "cls"})))
    assert any("splade requires task sparse" in e
               for e in errors_of(with_(MIG, model={"id": "x", "task": "embed", "pooling": "splade"})))
    assert any("defaultPromptName and defaultPrompt are exclusive" in e for e in errors_of(
        with_(MIG, model={"id": "x", "prompts": {"defaultPromptName": "q", "defaultPrompt": "query: "}})))
    assert any("at most one of pvc or download" in e for e in errors_of(
        with_(MIG, model={"id": "x", "source": {"pvc": {"claimName": "m"}, "download": {}}})))
    assert any("model: Required value" in e for e in errors_of({"accelerator": {"cpu": {}}}))


def test_schema_checks():
    assert any("should be greater than or equal to 0" in e for e in errors_of(with_(MIG, replicas=-1)))
    assert any("Unsupported value" in e for e in errors_of(with_(CPU, accelerator={"cpu": {"instructionSets": ["sse9"]}})))
    assert any("should have at least 1 items" in e for e in errors_of(with_(MIG, gateway={"parentRefs": []})))


def test_defaults_applied_like_the_api_server():
    d = defaulted(es(MIG))["spec"]
    assert d["replicas"] == 1
    assert d["batching"] == {"maxBatchTokens": 16384, "maxConcurrentRequests": 512, "maxClientBatchSize": 32,
                             "autoTruncate": True}
    assert d["accelerator"]["mig"] == {"profile": "1g.10gb", "product": "H100-80GB", "count": 1, "strategy": "mixed"}
    assert d["monitoring"] == {"serviceMonitor": {"enabled": True, "interval": "30s"}}
    assert d["service"] == {"type": "ClusterIP", "port": 80, "maxConnectionAgeSeconds": 30}
    # pydantic applies the same defaults
    parsed = S.parse(es(MIG)).spec
    assert parsed.batching.max_batch_tokens == 16384 and parsed.accelerator.mig.product == "H100-80GB"


def test_a_client_batch_the_server_could_never_admit_is_refused():
    """Issue 53: maxClientBatchSize above maxConcurrentRequests, or above the batch lane's three quarters of it
    while the lanes are on, made requests that were answered 429 forever; the pods now refuse such flags at start."""
    over = errors_of(with_(MIG, batching={"maxConcurrentRequests": 16, "maxClientBatchSize": 32}))
    assert any("batching.maxClientBatchSize must not exceed batching.maxConcurrentRequests" in e for e in over)
    lane = errors_of(with_(MIG, batching={"maxConcurrentRequests": 40}))
    assert lane and all("the batch lane's share" in e for e in lane), lane
    assert errors_of(with_(MIG, batching={"maxConcurrentRequests": 40}, lanes={"enabled": False})) == []
    assert errors_of(with_(MIG, batching={"maxConcurrentRequests": 64, "maxClientBatchSize": 48})) == []
    # an object stored before the rules: the operator's parse says the same (InvalidSpec; nothing rendered)
    from embedops_operator.spec import parse
    with pytest.raises(Exception, match="batch lane's share"):
        parse(es(with_(MIG, batching={"maxConcurrentRequests": 40})))


def test_the_reindex_pod_and_every_env_stay_within_what_an_ingestion_job_needs():
    """Issue 53's side doors, refused by the operator itself (InvalidSpec: it renders nothing) whether or not the
    platform's admission policy is on: the reindex Job's pod template is an allowlist, and no env may point an
    interpreter or loader at code of the manifest's choosing."""
    from embedops_operator.spec import parse

    job = {"containers": [{"name": "ingest", "image": "acme/ingest:1", "env": [{"name": "TABLE", "value": "t"}],
                           "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
           "volumes": [{"name": "app", "configMap": {"name": "scripts"}}], "serviceAccountName": "ingest"}

    def with_job(**change):
        pod = copy.deepcopy(job)
        for k, v in change.items():
            if k.startswith("c_"):
                pod["containers"][0][k[2:]] = v
            else:
                pod[k] = v
        return with_(CPU, migration={"reindex": {"template": {"spec": pod}}})
    parse(es(with_job()))  # what an ingestion job needs: accepted
    probes = {
        "serviceAccount": with_job(serviceAccount="admin"),  # the alias the API server copies
        "initContainers": with_job(initContainers=[{"name": "x", "image": "a", "securityContext": {"privileged": True}}]),
        "hostNetwork": with_job(hostNetwork=True),
        "priorityClassName": with_job(priorityClassName="system-node-critical"),
        "privileged": with_job(c_securityContext={"privileged": True}),
        "SYS_ADMIN": with_job(c_securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
        "configMap, secret, emptyDir or persistentVolumeClaim": with_job(volumes=[{"name": "h", "hostPath": {"path": "/"}}]),
        "LD_PRELOAD": with_job(c_env=[{"name": "LD_PRELOAD", "value": "/models/x.so"}]),
        "PYTHONPATH": with_(CPU, env=[{"name": "PYTHONPATH", "value": "/models/evil"}]),
    }
    for said, spec in probes.items():
        with pytest.raises(Exception) as err:
            parse(es(spec))
        assert said in str(err.value) or "not allowed" in str(err.value), (said, str(err.value)[:300])


def test_the_reindex_jobs_pod_gets_no_token_unless_it_names_an_account():
    from embedops_operator import render as R

    template = {"spec": {"containers": [{"name": "ingest", "image": "acme/ingest:1"}]}}
    env = {"EMBEDOPS_SPACE": "abcd1234"}
    spec = S.parse(es(with_(CPU, migration={"reindex": {"template": template}}))).spec
    assert R.reindex_job("svc", "ml", spec, None, env)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    template["spec"]["serviceAccountName"] = "ingest"
    spec = S.parse(es(with_(CPU, migration={"reindex": {"template": template}}))).spec
    assert "automountServiceAccountToken" not in R.reindex_job("svc", "ml", spec, None, env)["spec"]["template"]["spec"]
