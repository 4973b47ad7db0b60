"""The chart's alerts (templates/prometheusrule.yaml), unit-tested with promtool: each fires in the situation
it names, after its `for`, with the labels and runbook a receiver routes on, and stays silent when things are
fine. promtool is built from the same Prometheus module as the Prometheus the e2e tests run
(localcluster/components.py)."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from localcluster.components import provided
from tests.unit.test_operator_chart import helm_binary, needs_helm, template



@pytest.fixture
def promtool() -> str:
    """promtool's path; under `make test` once its build beside the tests has made it (not at collection: the
    other tests of this lane run meanwhile)."""
    path = provided("prometheus", "promtool")
    if not path.exists():
        pytest.skip(f"promtool not built ({path}); `python -m localcluster.build prometheus`")
    return str(path)

RUNBOOKS = "https://github.com/example/embedops/blob/main/docs/runbooks.md"


def rules(annotations: bool = True) -> dict:
    """The chart's rule groups; without annotations, promtool compares labels only (one test below checks the
    rendered annotations of a firing alert)."""
    docs = template("alerts.enabled=true", "metrics.serviceMonitor.enabled=true")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    groups = rule["spec"]["groups"]
    if not annotations:
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    return {"groups": groups}


def series(name: str, labels: dict, values: str) -> dict:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


SVC = {"namespace": "ml", "service": "bge"}
POD = {**SVC, "pod": "bge-0", "endpoint": "http"}
OP = {"namespace": "embedops-system", "pod": "op-0"}


def alert(name: str, at: str, firing: list[dict]) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": firing}


def fired(severity: str, **labels) -> dict:
    return {"exp_labels": {"severity": severity, **labels}}


# name -> (input series, [alert tests]); each a minute-by-minute story
CASES = {
    "no ready replica": (
        [series("embedops_service_replicas", {**OP, **SVC, "state": "desired"}, "2x20"),
         series("embedops_service_replicas", {**OP, **SVC, "state": "ready"}, "2x5 0x15")],
        [alert("EmbeddingServiceNoReadyReplica", "4m", []),
         alert("EmbeddingServiceNoReadyReplica", "9m", []),      # 0 ready since 6m: for 5m not yet over
         alert("EmbeddingServiceNoReadyReplica", "12m", [fired("critical", **SVC)])]),
    "scaled to zero is not an outage": (
        [series("embedops_service_replicas", {**OP, **SVC, "state": "desired"}, "0x20"),
         series("embedops_service_replicas", {**OP, **SVC, "state": "ready"}, "0x20")],
        [alert("EmbeddingServiceNoReadyReplica", "15m", [])]),
    "5xx": (
        [series("te_queue_size", POD, "0x30"),
         series("te_request_count", {**POD, "method": "single"}, "0+100x30"),
         series("te_request_failure", {**POD, "err": "inference"}, "0+0x10 0+20x20"),
         series("te_request_failure", {**POD, "err": "validation"}, "0+50x30")],  # client errors do not count
        [alert("EmbeddingServiceErrors", "9m", []),
         alert("EmbeddingServiceErrors", "25m", [fired("critical", **SVC)])]),
    "429": (
        [series("te_queue_size", POD, "0x40"),
         series("te_request_count", {**POD, "method": "single"}, "0+100x40"),
         series("te_request_failure", {**POD, "err": "overloaded"}, "0+30x40")],
        [alert("EmbeddingServiceOverloaded", "8m", []),
         alert("EmbeddingServiceOverloaded", "20m", [fired("warning", **SVC)])]),
    # the rate over 5 minutes still sees a deleted service's samples; the guard on its gauge ends the alert with
    # the service (fails without it: still firing at 21m)
    "429 and 5xx, then the service is deleted": (
        [series("te_queue_size", POD, "0x20 stale"),
         series("te_request_count", {**POD, "method": "single"}, "0+100x20 stale"),
         series("te_request_failure", {**POD, "err": "overloaded"}, "0+30x20 stale"),
         series("te_request_failure", {**POD, "err": "inference"}, "0+30x20 stale")],
        [alert("EmbeddingServiceOverloaded", "20m", [fired("warning", **SVC)]),
         alert("EmbeddingServiceErrors", "20m", [fired("critical", **SVC)]),
         alert("EmbeddingServiceOverloaded", "21m", []),
         alert("EmbeddingServiceErrors", "21m", [])]),
    "queue backlog": (
        [series("te_queue_size", POD, "0 5 0 5 0x4 3x30"),
         series("te_queue_size", {**POD, "pod": "bge-1"}, "4x40")],
        [alert("EmbeddingServiceQueueBacklogged", "10m", []),
         alert("EmbeddingServiceQueueBacklogged", "25m", [fired("warning", **SVC)])]),
    "latency budget from the manifest": (
        # every request takes 0.3-0.5 s: over a 0.25 s budget, under the 2 s default
        [series("te_queue_size", POD, "0x30"),
         series("te_queue_size", {**POD, "service": "other"}, "0x30"),
         series("te_request_duration_bucket", {**POD, "le": "0.25"}, "0x30"),
         series("te_request_duration_bucket", {**POD, "le": "0.5"}, "0+10x30"),
         series("te_request_duration_bucket", {**POD, "le": "+Inf"}, "0+10x30"),
         series("embedops_service_p99_budget_seconds", {**OP, **SVC}, "0.25x30"),
         series("embedops_service_replicas", {**OP, **SVC, "state": "desired"}, "1x30"),
         series("te_request_duration_bucket", {**POD, "service": "other", "le": "0.25"}, "0x30"),
         series("te_request_duration_bucket", {**POD, "service": "other", "le": "0.5"}, "0+10x30"),
         series("te_request_duration_bucket", {**POD, "service": "other", "le": "+Inf"}, "0+10x30"),
         series("embedops_service_replicas", {**OP, "namespace": "ml", "service": "other", "state": "desired"},
                "1x30")],
        [alert("EmbeddingServiceLatencyOverBudget", "8m", []),
         alert("EmbeddingServiceLatencyOverBudget", "20m", [fired("warning", **SVC)])]),
    "restarts": (
        [series("embedops_service_pod_restarts", {**OP, **SVC}, "0x5 1 2 3 4 5 6 7 8x20")],
        [alert("EmbeddingServicePodsRestarting", "5m", []),
         alert("EmbeddingServicePodsRestarting", "16m", [fired("warning", **SVC)])]),
    # a deleted service's series goes stale; increase() over 15 min would still see its old samples and keep
    # the alert firing for up to 15 minutes after the delete (seen on the live Prometheus)
    "restarts, then the service is deleted": (
        [series("embedops_service_pod_restarts", {**OP, **SVC}, "0 1 2 3 4 5 6 7 8x10 stale")],
        [alert("EmbeddingServicePodsRestarting", "18m", [fired("warning", **SVC)]),
         alert("EmbeddingServicePodsRestarting", "20m", [])]),
    "not ready and stalled": (
        [series("embedops_service_condition", {**OP, **SVC, "type": "Ready", "status": "False"}, "1x30"),
         series("embedops_service_condition", {**OP, **SVC, "type": "Stalled", "status": "True"}, "0x10 1x20")],
        [alert("EmbeddingServiceNotReady", "10m", []),
         alert("EmbeddingServiceNotReady", "20m", [fired("warning", **SVC)]),
         alert("EmbeddingServiceStalled", "12m", []),
         alert("EmbeddingServiceStalled", "20m", [fired("critical", **SVC)])]),
    "operator": (
        [series("embedops_operator_leader", {**OP}, "1x5 0x20"),
         series("embedops_operator_leader", {**OP, "pod": "op-1"}, "0x25"),
         series("embedops_operator_reconciles_total", {**OP, "result": "ok"}, "0+10x35"),
         series("embedops_operator_reconciles_total", {**OP, "result": "error"}, "0x5 0+30x30")],
        [alert("EmbeddingOperatorDown", "10m", []),
         alert("EmbeddingOperatorDown", "20m", [fired("critical")]),
         alert("EmbeddingOperatorReconcileFailing", "10m", []),
         alert("EmbeddingOperatorReconcileFailing", "30m", [fired("warning")])]),
    "operator near its memory limit": (
        [series("process_resident_memory_bytes", {**OP}, "100000000x5 220000000x20"),
         series("embedops_operator_memory_limit_bytes", {**OP}, "268435456x25"),
         series("process_resident_memory_bytes", {**OP, "pod": "unlimited"}, "900000000x25")],
        [alert("EmbeddingOperatorNearMemoryLimit", "10m", []),
         alert("EmbeddingOperatorNearMemoryLimit", "20m", [fired("warning", **OP)])]),
    "operator never scraped": (
        [series("up", {"job": "other"}, "1x20")],
        [alert("EmbeddingOperatorDown", "15m", [fired("critical")])]),
}


@needs_helm
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.replace(" ", "-"))
def test_alert_fires_in_its_situation_and_not_before(case, tmp_path, promtool):
    inputs, tests = CASES[case]
    promtool_test(promtool, tmp_path, rules(annotations=False), inputs, tests)


def promtool_test(promtool: str, tmp_path, rule_groups: dict, inputs: list, tests: list) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": tests}]}))
    r = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
def test_a_firing_alert_says_what_and_where_with_its_runbook(tmp_path, promtool):
    inputs, _ = CASES["5xx"]
    promtool_test(promtool, tmp_path, rules(), inputs, [alert("EmbeddingServiceErrors", "25m", [{
        "exp_labels": {"severity": "critical", **SVC},
        "exp_annotations": {
            "summary": "An EmbeddingService answers 5xx",
            "description": "ml/bge: 20% of requests fail with a server error.",
            "runbook_url": f"{RUNBOOKS}#embeddingserviceerrors"}}])])


@needs_helm
def test_rules_are_valid_and_each_has_a_runbook_section(tmp_path, promtool):
    from tests.unit.operator_helpers import REPO

    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules()))
    r = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    runbooks = (REPO / "docs" / "runbooks.md").read_text()
    names = [x["alert"] for g in rules()["groups"] for x in g["rules"]]
    assert len(names) == 11
    tested = {t["alertname"] for _, tests in CASES.values() for t in tests}
    assert set(names) == tested, set(names) ^ tested
    for g in rules()["groups"]:
        for x in g["rules"]:
            anchor = x["alert"].lower()
            assert x["annotations"]["runbook_url"] == f"{RUNBOOKS}#{anchor}"
            assert f"\n## {x['alert']}\n" in runbooks, f"docs/runbooks.md has no section for {x['alert']}"
            assert x["labels"]["severity"] in ("critical", "warning")


@needs_helm
def test_alerts_and_the_operators_service_monitor_are_off_by_default():
    kinds = {d["kind"] for d in template()}
    assert "PrometheusRule" not in kinds and "ServiceMonitor" not in kinds
    docs = template("alerts.enabled=true")  # without the operator's metrics: no "operator down" noise
    names = [x["alert"] for d in docs if d["kind"] == "PrometheusRule" for g in d["spec"]["groups"]
             for x in g["rules"]]
    assert "EmbeddingOperatorDown" not in names and "EmbeddingServiceStalled" in names
    assert helm_binary()
