"""The operator benchmark's pure parts (the run itself needs the local control plane and minutes)."""
from __future__ import annotations

from bench import operator_bench as OB

METRICS = """# HELP apiserver_request_total x
apiserver_request_total{code="200",verb="GET",resource="pods"} 10
apiserver_request_total{code="201",verb="POST",resource="pods"} 2.5e+01
apiserver_flowcontrol_dispatched_requests_total{flow_schema="embedops-bench-operator",priority_level="workload-high"} 7
apiserver_flowcontrol_dispatched_requests_total{flow_schema="exempt",priority_level="exempt"} 100
"""


def test_metric_sums():
    assert OB.metric_sum(METRICS, "apiserver_request_total") == 35
    assert OB.metric_sum(METRICS, "apiserver_flowcontrol_dispatched_requests_total",
                         {"flow_schema": OB.FLOW_SCHEMA}) == 7


def test_floor_is_what_the_operator_renders_without_owners():
    ms = OB.floor_manifests(3)
    assert [m["kind"] for m in ms] == ["Deployment", "Service"] * 3
    assert all("ownerReferences" not in m["metadata"] and m["metadata"]["namespace"] == OB.FLOOR_NS for m in ms)


def test_nodes_hold_the_fleet_and_table_renders():
    nodes = OB.bench_nodes(1000)
    assert sum(int(n["status"]["capacity"]["pods"]) for n in nodes) >= 1000
    out = OB.table([{"label": "after", "n": 200, "floor_ready_s": 10.0, "operator_ready_s": 12.0, "vs_floor": 1.2,
                     "rest_per_min": 3.0}, {"label": "x", "n": 5, "error": "boom"}])
    assert "after" in out and "1.20" in out and "error: boom" in out
    assert OB.targets_check([{"label": "a", "n": 200, "rest_per_min": 3.0}]) == ["a N=200: at rest 3.0/min (target <= 20)"]


def test_restart_columns_and_target():
    row = {"label": "after", "n": 5000, "peak_rss_mb": 180.0, "restart_s": 30.0, "restart_peak_rss_mb": 210.0,
           "restart_cpu_s": 20.0, "restart_requests_operator": 150, "restart_deployment_applies": 0}
    out = OB.table([row])
    assert "restart MB" in out and " 210 " in out
    assert OB.targets_check([row]) == [
        "after N=5000: RSS through the ramp 180.0 MB and the restart 210.0 MB (issue 58: <= 300 at 5,000)"]
