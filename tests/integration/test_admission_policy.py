"""Who may serve what (issue 35, point 2): the chart's ValidatingAdmissionPolicy on the real API server (GA in 1.30;
the local control plane runs 1.34) refuses each manifest outside the platform's allowlists with the message its
author reads, lets every example through, and the chart's aggregated ClusterRoles give a namespace's `edit` users
EmbeddingServices and its `view` users read access only."""
from __future__ import annotations

import copy
import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.operator_process import GROUP, PLURAL, REPO, VERSION, delete_cluster_scoped, install_crd

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
EXAMPLES = ["cpu-ingestion.yaml", "mig-embedder.yaml", "mig-reranker.yaml", "bge-m3-cpu-ingestion.yaml"]
BASE = {"model": {"id": "BAAI/bge-small-en-v1.5"}, "accelerator": {"cpu": {"cores": 1}}}


@pytest.fixture(scope="module")
def env(kube):
    from kubernetes import client

    if not kube.helm:
        pytest.skip("helm not available (make cluster-binaries)")
    api = kube.api_client()
    install_crd(kube, api)
    out = subprocess.run([kube.helm, "template", "vap", str(REPO / "charts" / "embedops-operator"),
                          "--set", "admissionPolicy.enabled=true",
                          "--set", "admissionPolicy.allowedImageRegistries={ghcr.io/embedops/,registry.corp/ml/}",
                          "--set", "admissionPolicy.allowedServiceAccounts={embedder}",
                          "--set", "admissionPolicy.allowedPriorityClasses={ml-online}",
                          "--set-json", 'admissionPolicy.namespaceSelector={"matchLabels":{"embedops.dev/vap":"on"}}'],
                         capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] in (
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ClusterRole")
        and not d["metadata"]["name"].endswith(("-metrics-auth", "-metrics-reader"))]  # their own test
    assert sorted(d["kind"] for d in docs) == ["ClusterRole", "ClusterRole", "ClusterRole",
                                                "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy",
                                                "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"]
    kube.apply(docs)
    with kube.namespace("vap", labels={"embedops.dev/vap": "on"}) as ns:
        e = type("Env", (), {})()
        e.api, e.ns, e.custom = api, ns, client.CustomObjectsApi(api)
        try:
            yield e
        finally:
            _delete_policy(api, docs)
            delete_cluster_scoped(api, docs)
    api.close()


def _delete_policy(api, docs):
    from kubernetes import client

    adm = client.AdmissionregistrationV1Api(api)
    for d in docs:
        try:
            if d["kind"] == "ValidatingAdmissionPolicyBinding":
                adm.delete_validating_admission_policy_binding(d["metadata"]["name"])
            elif d["kind"] == "ValidatingAdmissionPolicy":
                adm.delete_validating_admission_policy(d["metadata"]["name"])
        except Exception:  # noqa: BLE001 - best effort
            pass


def create(env, name: str, spec: dict) -> str | None:
    """A server-side dry-run create: None when admitted, else the API server's message."""
    from kubernetes.client.rest import ApiException

    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EmbeddingService", "metadata": {"name": name}, "spec": spec}
    try:
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, body, dry_run="All")
    except ApiException as exc:
        return json.loads(exc.body).get("message", exc.body)
    return None


def job(**change) -> dict:
    """BASE with a reindex Job whose pod template has `change` (c_<field>: on its container)."""
    pod: dict = {"containers": [{"name": "i", "image": "registry.corp/ml/i:1"}]}
    for k, v in change.items():
        if k.startswith("c_"):
            pod["containers"][0][k[2:]] = v
        else:
            pod[k] = v
    return {**BASE, "migration": {"reindex": {"template": {"spec": pod}}}}


def test_each_rule_refuses_with_the_message_an_author_reads_and_the_examples_pass(env):
    bad_image = {**BASE, "image": "docker.io/attacker/miner:1"}
    deadline = time.monotonic() + 60  # the API server compiles a new policy within a few seconds
    while create(env, "probe", bad_image) is None:
        assert time.monotonic() < deadline, "the policy never took effect"
        time.sleep(0.5)
    reindex = {"template": {"spec": {"containers": [{"name": "ingest", "image": "registry.corp/ml/ingest:3"}]}}}
    cases = {
        "image": (bad_image, "images must come from ghcr.io/embedops/, registry.corp/ml/ (the platform allows only "
                             "those): docker.io/attacker/miner:1"),
        "download-image": ({**BASE, "model": {"id": "x", "source": {"download": {"image": "quay.io/x/y:1"}}}},
                           "images must come from"),
        "reindex-image": ({**BASE, "migration": {"reindex": {"template": {"spec": {"containers": [
            {"name": "i", "image": "docker.io/x:1"}]}}}}}, ": docker.io/x:1"),
        "account": ({**BASE, "serviceAccountName": "cluster-admin-sa"},
                    "serviceAccountName may only be one of [embedder]"),
        "job-account": ({**BASE, "migration": {"reindex": {"template": {"spec": {"serviceAccountName": "root",
                         "containers": [{"name": "i", "image": "registry.corp/ml/i:1"}]}}}}},
                        "serviceAccountName may only be one of [embedder]"),
        "loadbalancer": ({**BASE, "service": {"type": "LoadBalancer"}},
                         "service.type LoadBalancer is not allowed here; allowed: ClusterIP"),
        "tolerate-all": ({**BASE, "tolerations": [{"operator": "Exists"}]},
                         "tolerations may only name the keys [nvidia.com/gpu]"),
        "priority": ({**BASE, "priorityClassName": "system-node-critical"},
                     "priorityClassName system-node-critical is not allowed here; allowed: [ml-online]"),
        "prometheus": ({**BASE, "autoscaling": {"maxReplicas": 2, "prometheusAddress": "http://169.254.169.254/"}},
                       "autoscaling.prometheusAddress must be one of [http://prometheus-operated.monitoring.svc:9090]"),
        "hostpath": ({**BASE, "migration": {"reindex": {"template": {"spec": {
            "containers": [{"name": "i", "image": "registry.corp/ml/i:1"}],
            "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}}}}, "may not use hostNetwork, hostPID, hostPath"),
        # issue 53's side doors, each accepted before
        "job-service-account-alias": (job(serviceAccount="default"), "may set only containers, volumes, restartPolicy"),
        "job-init-privileged": (job(initContainers=[{"name": "x", "image": "registry.corp/ml/i:1",
                                                     "securityContext": {"privileged": True}}]), "not: initContainers"),
        "job-sys-admin": (job(c_securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
                          "without privilege, privilege escalation or added capabilities"),
        "job-toleration": (job(tolerations=[{"operator": "Exists"}]), "template tolerations may only name the keys"),
        "job-priority": (job(priorityClassName="system-node-critical"), "not: priorityClassName"),
        "job-ld-preload": (job(c_env=[{"name": "LD_PRELOAD", "value": "/models/x.so"}]), "interpreter's or loader's"),
        "pythonpath": ({**BASE, "env": [{"name": "PYTHONPATH", "value": "/models/evil"}]}, "interpreter's or loader's"),
    }
    refused = {}
    for name, (spec, want) in cases.items():
        msg = create(env, name, spec)
        refused[name] = msg
        assert msg is not None and want in msg, (name, msg)
    print("refused:\n  " + "\n  ".join(f"{k}: {v}" for k, v in refused.items()))
    # what the platform allows passes: the examples, and the allowed values of each rule
    for f in EXAMPLES:
        doc = yaml.safe_load((REPO / "examples" / f).read_text())
        assert create(env, doc["metadata"]["name"], doc["spec"]) is None, f
    for doc in yaml.safe_load_all((REPO / "examples" / "query-time" / "services.yaml").read_text()):
        assert create(env, doc["metadata"]["name"], doc["spec"]) is None
    allowed = {**BASE, "image": "registry.corp/ml/embedops-server:2-cpu", "serviceAccountName": "embedder",
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "priorityClassName": "ml-online", "autoscaling": {"maxReplicas": 2},
               "migration": {"promotion": "AfterReindex", "reindex": copy.deepcopy(reindex)}}
    assert create(env, "allowed", allowed) is None


def test_namespace_editors_manage_and_viewers_read_embedding_services(env, kube):
    from kubernetes import client

    rbac, authz = client.RbacAuthorizationV1Api(env.api), client.AuthorizationV1Api(env.api)
    for user, role in (("alice", "edit"), ("bob", "view")):
        rbac.create_namespaced_role_binding(env.ns, {
            "metadata": {"name": f"{user}-{role}"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}]})

    def can(user, verb, sub=None):
        review = authz.create_subject_access_review({"spec": {"user": user, "resourceAttributes": {
            "namespace": env.ns, "group": GROUP, "resource": PLURAL, "verb": verb, **({"subresource": sub} if sub else {})}}})
        return review.status.allowed

    deadline = time.monotonic() + 30  # the aggregation controller fills the default roles' rules
    while not can("alice", "create"):
        assert time.monotonic() < deadline, "edit never aggregated the EmbeddingService rules"
        time.sleep(0.5)
    assert can("alice", "delete") and can("alice", "update", "scale") and not can("alice", "update", "status")
    assert can("bob", "list") and can("bob", "get", "status") and not can("bob", "create")
    assert not can("carol", "get")


OPERATOR_SA = ("default", "vap-embedops-operator")  # `helm template vap` in namespace default
ACTIVATOR = {"app.kubernetes.io/name": "embedops-activator", "app.kubernetes.io/instance": "svc"}
REINDEX = {"app.kubernetes.io/component": "reindex", "embedops.dev/space": "aaaaaaaa"}


def _pod_spec() -> dict:
    return {"containers": [{"name": "c", "image": "registry.corp/ml/i:1"}], "automountServiceAccountToken": False,
            "nodeSelector": {"embedops.dev/no-such-node": "true"}}  # created, never run


def _workloads(name: str, labels: dict) -> dict[str, tuple]:
    """(create function's name, API, body) of a pod and each workload kind whose pod template carries `labels`."""
    from kubernetes import client

    tmpl = {"metadata": {"labels": labels}, "spec": _pod_spec()}
    sel = {"matchLabels": labels}
    job_tmpl = {"metadata": {"labels": labels}, "spec": {**_pod_spec(), "restartPolicy": "Never"}}
    return {
        "Pod": ("create_namespaced_pod", client.CoreV1Api, {"metadata": {"name": name, "labels": labels},
                                                            "spec": _pod_spec()}),
        "Deployment": ("create_namespaced_deployment", client.AppsV1Api,
                       {"metadata": {"name": name}, "spec": {"replicas": 1, "selector": sel, "template": tmpl}}),
        "ReplicaSet": ("create_namespaced_replica_set", client.AppsV1Api,
                       {"metadata": {"name": name}, "spec": {"replicas": 1, "selector": sel, "template": tmpl}}),
        "StatefulSet": ("create_namespaced_stateful_set", client.AppsV1Api,
                        {"metadata": {"name": name}, "spec": {"serviceName": name, "selector": sel,
                                                              "template": tmpl}}),
        "DaemonSet": ("create_namespaced_daemon_set", client.AppsV1Api,
                      {"metadata": {"name": name}, "spec": {"selector": sel, "template": tmpl}}),
        "Job": ("create_namespaced_job", client.BatchV1Api, {"metadata": {"name": name}, "spec": {"template": job_tmpl}}),
        "CronJob": ("create_namespaced_cron_job", client.BatchV1Api, {"metadata": {"name": name}, "spec": {
            "schedule": "0 0 1 1 *", "jobTemplate": {"spec": {"template": job_tmpl}}}}),
        "ReplicationController": ("create_namespaced_replication_controller", client.CoreV1Api,
                                  {"metadata": {"name": name}, "spec": {"replicas": 1, "selector": labels,
                                                                        "template": tmpl}}),
    }


def _create(api, ns: str, how: tuple, dry_run: bool = True) -> str | None:
    """None when admitted, else the API server's message."""
    from kubernetes.client.rest import ApiException

    fn, cls, body = how
    try:
        getattr(cls(api), fn)(ns, body, **({"dry_run": "All"} if dry_run else {}))
    except ApiException as exc:
        return json.loads(exc.body).get("message", exc.body)
    return None


def test_the_labels_a_network_policy_admits_are_the_operators_alone(env, kube):
    """Issue 53: a service's NetworkPolicy (allowSameNamespace: false) admits its activator's and its reindex Jobs'
    pods by label, and a label is what any pod of the namespace may carry. With the chart's policy only the
    operator's ServiceAccount puts them on a pod template and only the cluster's controllers on a pod: every way
    a tenant could make such a pod is refused, and the operator's own Deployment and Job get their pods."""
    from kubernetes import client

    core = client.CoreV1Api(env.api)
    deadline = time.monotonic() + 60
    while _create(env.api, env.ns, _workloads("probe", ACTIVATOR)["Pod"]) is None:
        assert time.monotonic() < deadline, "the reserved-labels policy never took effect"
        time.sleep(0.5)
    refused = {}
    for claim, labels in (("activator", ACTIVATOR), ("reindex", REINDEX)):
        for kind, how in _workloads(f"copy-{claim}", labels).items():
            msg = _create(env.api, env.ns, how)
            assert msg is not None and "are reserved for the pods the embedops operator makes" in msg, (claim, kind, msg)
            refused[f"{claim} {kind}"] = msg
    print(f"refused ({len(refused)}): {next(iter(refused.values()))}")
    # a team's own pods named component=reindex (without embedops' space label) are theirs to make
    assert _create(env.api, env.ns, _workloads("own-reindex", {"app.kubernetes.io/component": "reindex"})["Job"]) is None
    # a label added to a running pod
    assert _create(env.api, env.ns, _workloads("plain", {"app": "plain"})["Pod"], dry_run=False) is None
    from kubernetes.client.rest import ApiException
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("plain", env.ns, {"metadata": {"labels": ACTIVATOR}})
    assert "reserved" in json.loads(exc.value.body)["message"]

    # the operator's ServiceAccount (impersonated, with the namespace's admin role as its ClusterRole gives it)
    sa_ns, sa = OPERATOR_SA
    client.RbacAuthorizationV1Api(env.api).create_namespaced_role_binding(env.ns, {
        "metadata": {"name": "operator-admin"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                            "kind": "ClusterRole", "name": "admin"},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_ns}]})
    operator_api = kube.api_client()
    operator_api.default_headers["Impersonate-User"] = f"system:serviceaccount:{sa_ns}:{sa}"
    try:
        for kind, labels in (("Deployment", ACTIVATOR), ("Job", REINDEX)):
            deadline = time.monotonic() + 30  # RBAC's cache takes the binding within a moment
            while (msg := _create(operator_api, env.ns, _workloads(f"op-{kind.lower()}", labels)[kind],
                                  dry_run=False)) is not None and "forbidden" in msg and "reserved" not in msg:
                assert time.monotonic() < deadline, msg
                time.sleep(0.3)
            assert msg is None, (kind, msg)
    finally:
        operator_api.close()
    # the controllers make their pods (a ReplicaSet, then a pod; a Job's pod), each carrying the reserved labels
    selector = ",".join(f"{k}={v}" for k, v in ACTIVATOR.items())
    deadline = time.monotonic() + 60
    while not (core.list_namespaced_pod(env.ns, label_selector=selector).items
               and core.list_namespaced_pod(env.ns, label_selector="embedops.dev/space=aaaaaaaa").items):
        events = [f"{e.involved_object.kind}/{e.involved_object.name}: {e.message}"
                  for e in core.list_namespaced_event(env.ns).items if e.type == "Warning"]
        assert time.monotonic() < deadline, f"the controllers made no pod of the operator's workloads: {events}"
        time.sleep(0.5)
    # a rollout restart by a person (an update of an object that carries them already) is not refused
    client.AppsV1Api(env.api).patch_namespaced_deployment("op-deployment", env.ns, {"spec": {"template": {"metadata": {
        "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-07T00:00:00Z"}}}}})
