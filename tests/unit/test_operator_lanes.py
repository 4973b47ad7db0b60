"""spec.lanes: the server's lane flags, the batch lane's own address `<name>-batch` (the serving track's pods, so
one embedding space behind both addresses), its port in the NetworkPolicy, and KEDA scaling on the interactive
lane's queue. A service without spec.lanes renders exactly what it did (tests/unit/pod_templates/r3.json)."""
from __future__ import annotations

import copy

from embedops_operator import render as R
from embedops_operator.validate import defaulted, validate
from tests.unit.operator_helpers import CPU, es

KEDA = R.Options(capabilities=frozenset({R.SCALEDOBJECT}))


def rendered(lanes: dict | None, options: R.Options = KEDA, tracks: R.Tracks | None = None, **extra) -> dict:
    spec = copy.deepcopy(CPU)
    if lanes is not None:
        spec["lanes"] = lanes
    spec.update(extra)
    out = R.render(defaulted(es(spec, name="svc")), options, tracks=tracks)
    return {(m["kind"], m["metadata"]["name"]): m for m in out}


def server(objs: dict, name: str = "svc") -> dict:
    return next(c for c in objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
                if c["name"] == "server")


def test_without_lanes_nothing_changes():
    objs = rendered(None)
    args = server(objs)["args"]
    assert not {"--lanes", "--default-lane", "--batch-port"} & set(args)
    assert [p["name"] for p in server(objs)["ports"]] == ["http", "metrics"]  # the metrics port is revision 7's, lanes or not
    assert ("Service", "svc-batch") not in objs
    # an empty lanes: the server's defaults, nothing rendered either
    assert server(rendered({}))["args"] == args


def test_lane_flags():
    args = server(rendered({"enabled": False, "default": "batch"}))["args"]
    assert args[args.index("--lanes") + 1] == "false" and args[args.index("--default-lane") + 1] == "batch"
    prepare = next(c for c in rendered({"default": "interactive"})[("Deployment", "svc")]["spec"]["template"]
                   ["spec"]["initContainers"] if c["name"] == "prepare")
    assert "--default-lane" in prepare["args"]  # the same flags: the prepare step parses them as the server does


def test_the_batch_service_is_the_serving_tracks_pods_on_their_batch_port():
    objs = rendered({"batchService": True}, autoscaling={"minReplicas": 1, "maxReplicas": 3})
    srv = server(objs)
    assert srv["args"][srv["args"].index("--batch-port") + 1] == str(R.BATCH_PORT)
    assert {"name": "batch", "containerPort": R.BATCH_PORT, "protocol": "TCP"} in srv["ports"]
    batch = objs[("Service", "svc-batch")]
    main = objs[("Service", "svc")]
    assert batch["spec"]["selector"] == main["spec"]["selector"]
    assert batch["spec"]["ports"][0]["targetPort"] == "batch"
    assert batch["metadata"]["labels"][R.LABEL_INSTANCE] == "svc-batch"  # not scraped twice
    # during a change of the embedding space it follows the serving track, as the service's own address does
    moving = rendered({"batchService": True}, tracks=R.Tracks("svc-b", "svc"))
    assert moving[("Service", "svc-batch")]["spec"]["selector"] == moving[("Service", "svc")]["spec"]["selector"]
    spec = R.parse_resource(defaulted(es({**CPU, "lanes": {"batchService": True}}, name="svc"))).spec
    assert R.endpoints("svc", "ns", spec, R.Options())["batch"] == "http://svc-batch.ns.svc.cluster.local"


def test_the_network_policy_admits_the_batch_port():
    objs = rendered({"batchService": True}, networkPolicy={})
    rule, _ = objs[("NetworkPolicy", "svc")]["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {R.SERVER_PORT, R.BATCH_PORT}
    rule, _ = rendered(None, networkPolicy={})[("NetworkPolicy", "svc")]["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {R.SERVER_PORT}


def test_keda_scales_on_the_interactive_lanes_queue_unless_told_all():
    def query(lanes):
        objs = rendered(lanes, autoscaling={"minReplicas": 1, "maxReplicas": 3, "provider": "keda"})
        return objs[("ScaledObject", "svc")]["spec"]["triggers"][0]["metadata"]["query"]

    assert query(None).startswith("sum(te_queue_size{")
    assert 'embedops_lane_queue_size{namespace="ml",service="svc",lane="interactive"}' in query({})
    assert query({"scaleOn": "all"}).startswith("sum(te_queue_size{")
    assert query({"enabled": False}).startswith("sum(te_queue_size{")


def test_a_batch_service_is_refused_for_a_service_that_scales_to_zero():
    spec = {**copy.deepcopy(CPU), "lanes": {"batchService": True},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    errs = validate(es(spec))
    assert any("lanes.batchService needs autoscaling.minReplicas of at least 1" in e for e in errs), errs
    spec["autoscaling"]["minReplicas"] = 1
    assert validate(es(spec)) == []
    assert validate(es({**copy.deepcopy(CPU), "lanes": {"default": "fast"}}))  # an unknown lane: refused


def test_litellm_gets_a_batch_model_at_the_batch_address():
    objs = rendered({"batchService": True}, litellm={"configMapName": "litellm"})
    text = next(m for (kind, _), m in objs.items() if kind == "ConfigMap")["data"]
    (config,) = text.values()
    assert "model_name: svc-batch" in config.replace('"', "") or "svc-batch" in config
    assert "http://svc-batch.default.svc.cluster.local" in config or "svc-batch." in config
    plain = next(m for (kind, _), m in rendered({}, litellm={"configMapName": "litellm"}).items() if kind == "ConfigMap")
    assert "-batch" not in next(iter(plain["data"].values()))
