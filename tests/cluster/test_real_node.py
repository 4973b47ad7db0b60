"""The real node ``cpu-real-0`` (localcluster/node.py): real pods on this machine, joined to the local cluster.

Skipped, with the recorded reason, only where the machine refuses (a package, the kernel, privileges);
``EMBEDOPS_REQUIRE_REAL_NODE=1`` turns that skip into a failure. The last test takes the session's real
node down, checks that nothing of it is left on the machine, and brings it back.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

KUBECTL = "/usr/bin/kubectl"


@pytest.fixture(scope="module")
def real(kube):
    from localcluster import node

    if not kube.real_node:
        msg = f"no real node: {kube.real_node_reason}"
        if os.environ.get("EMBEDOPS_REQUIRE_REAL_NODE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    name, tar = node.busybox_image()
    kube.import_images([tar])
    return {"node": kube.real_node, "image": name}


@pytest.fixture
def core(kube):
    from kubernetes import client

    with kube.api_client() as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def ns(kube, real):
    with kube.namespace("rn") as name:
        yield name


def _pod(real, name, command, *, labels=None, memory="64Mi", restart="Never"):
    from localcluster.node import REAL_NODE_LABEL

    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "restartPolicy": restart, "terminationGracePeriodSeconds": 1, "enableServiceLinks": False,
            "containers": [{"name": "c", "image": real["image"], "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", command],
                            "resources": {"limits": {"cpu": "100m", "memory": memory}}}],
        },
    }


def _running(core, ns, name):
    p = core.read_namespaced_pod(name, ns)
    return p if p.status.phase == "Running" and p.status.pod_ip else None


def _kubectl(kube, *args, check=True, timeout=30):
    p = subprocess.run([KUBECTL, f"--kubeconfig={kube.kubeconfig}", *args], capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: rc={p.returncode}: {p.stderr}")
    return p


def _tcp_read(host, port, timeout=5.0) -> bytes:
    with socket.create_connection((host, port), timeout=timeout) as s:
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data


def test_node_ready_with_labels_and_real_capacity(kube, core, real):
    from localcluster.node import REAL_NODE_LABEL, REAL_NODE_TAINT, nfd_labels

    n = core.read_node(real["node"])
    assert any(c.type == "Ready" and c.status == "True" for c in n.status.conditions)
    labels = n.metadata.labels
    assert labels[REAL_NODE_LABEL] == "true"
    for k, v in nfd_labels().items():
        assert labels.get(k) == v, k
    assert "kwok.x-k8s.io/node" not in (n.metadata.annotations or {})
    assert int(n.status.capacity["cpu"]) == os.cpu_count()  # what the kubelet reports, not made up
    if os.environ.get("EMBEDOPS_REAL_NODE_TAINT", "1") != "0":
        assert any(t.key == REAL_NODE_TAINT["key"] and t.effect == "NoSchedule" for t in n.spec.taints or [])
    assert n.status.addresses[0].address == "10.245.0.1"
    assert n.status.node_info.kubelet_version == "v1.34.4"


def test_pod_ip_service_from_host_and_pod_logs_exec(kube, core, ns, real):
    kube.apply([_pod(real, "web", "exec nc -ll -p 8080 -e /bin/echo hello-web", labels={"app": "web"}),
                _pod(real, "client", "echo client-started; exec sleep 3600")], namespace=ns)
    web = wait_for(lambda: _running(core, ns, "web"), timeout=60, what="web Running")
    wait_for(lambda: _running(core, ns, "client"), timeout=60, what="client Running")
    assert web.spec.node_name == real["node"]
    assert ipaddress.ip_address(web.status.pod_ip) in ipaddress.ip_network("10.245.0.0/24")
    # the pod IP from the host
    assert wait_for(lambda: _try(lambda: _tcp_read(web.status.pod_ip, 8080)), timeout=20,
                    what="pod IP answers") == b"hello-web\n"
    kube.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                 "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}],
               namespace=ns)
    ip = core.read_namespaced_service("web", ns).spec.cluster_ip
    # the Service from the host (kube-proxy's DNAT in OUTPUT) ...
    assert wait_for(lambda: _try(lambda: _tcp_read(ip, 80)), timeout=30,
                    what="ClusterIP answers from the host") == b"hello-web\n"
    # ... and from another pod (through the bridge), via kubectl exec
    out = wait_for(lambda: _kubectl(kube, "-n", ns, "exec", "client", "--", "nc", "-w", "3", ip, "80",
                                    check=False).stdout, timeout=30, what="ClusterIP from a pod")
    assert out == "hello-web\n"
    # kubectl logs
    assert _kubectl(kube, "-n", ns, "logs", "client").stdout == "client-started\n"
    # the pods' resolv.conf: the cluster DNS only, never the host's resolvers
    resolv = _kubectl(kube, "-n", ns, "exec", "client", "--", "cat", "/etc/resolv.conf").stdout
    assert [ln.split()[1] for ln in resolv.splitlines() if ln.startswith("nameserver")] == ["10.245.0.1"]
    assert f"search {ns}.svc.cluster.local svc.cluster.local cluster.local" in resolv


def _try(fn):
    try:
        return fn()
    except OSError:
        return None


def test_network_policy_is_enforced_by_kube_router(kube, core, ns, real):
    """kube-router's firewall on the node: a policy admitting one namespace lets that namespace's pod in, refuses
    another namespace's at once (a reject, not a silent drop), and the node itself (kubelet probes) still gets
    through. Its ipsets exist meanwhile (down() removes what is left of them; the last test checks)."""
    from localcluster.node import _ipsets, _kube_router_set

    kube.apply([_pod(real, "fw", "exec nc -ll -p 8080 -e /bin/echo hello-fw", labels={"app": "fw"}),
                _pod(real, "friend", "exec sleep 3600")], namespace=ns)
    kube.apply([{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "fw"},
                 "spec": {"podSelector": {"matchLabels": {"app": "fw"}}, "policyTypes": ["Ingress"],
                          "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 8080, "protocol": "TCP"}]}]}}],
               namespace=ns)
    fw = wait_for(lambda: _running(core, ns, "fw"), timeout=60, what="fw Running")
    wait_for(lambda: _running(core, ns, "friend"), timeout=60, what="friend Running")
    ip = fw.status.pod_ip
    nc = ["nc", "-w", "3", ip, "8080"]
    out = wait_for(lambda: _kubectl(kube, "-n", ns, "exec", "friend", "--", *nc, check=False).stdout, timeout=30,
                   what="the same namespace admitted")
    assert out == "hello-fw\n"
    assert wait_for(lambda: _try(lambda: _tcp_read(ip, 8080)), timeout=20, what="the node admitted") == b"hello-fw\n"
    with kube.namespace("rn-other") as other:
        kube.apply([_pod(real, "stranger", "exec sleep 3600")], namespace=other)
        wait_for(lambda: _running(core, other, "stranger"), timeout=60, what="stranger Running")
        refused = _kubectl(kube, "-n", other, "exec", "stranger", "--", *nc, check=False)
        assert refused.stdout == "" and refused.returncode != 0, refused
        assert "refused" in refused.stderr.lower(), refused.stderr  # rejected: the client hears it at once
    assert any(_kube_router_set(n) for n in _ipsets()), _ipsets()


def test_cluster_dns_in_a_pod_and_nothing_outside(kube, core, ns, real):
    kube.apply([_pod(real, "dns", "exec sleep 3600"),
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "named"},
                 "spec": {"selector": {"app": "none"}, "ports": [{"port": 80}]}}], namespace=ns)
    wait_for(lambda: _running(core, ns, "dns"), timeout=60, what="dns pod Running")
    ip = core.read_namespaced_service("named", ns).spec.cluster_ip
    fqdn = f"named.{ns}.svc.cluster.local"
    out = wait_for(lambda: (lambda p: p.stdout if ip in p.stdout else None)(
        _kubectl(kube, "-n", ns, "exec", "dns", "--", "nslookup", "-type=a", fqdn, check=False)),
        timeout=30, what=f"{fqdn} resolves in the pod")
    assert ip in out
    # the short name through the search path
    assert ip in _kubectl(kube, "-n", ns, "exec", "dns", "--", "nslookup", "-type=a", "named", check=False).stdout
    # a name outside the cluster: refused by CoreDNS (no forwarding), nothing resolved
    p = _kubectl(kube, "-n", ns, "exec", "dns", "--", "nslookup", "-type=a", "example.com.", check=False)
    assert p.returncode != 0 and "Address" not in p.stdout.split("example.com", 1)[-1], p.stdout


def test_memory_limit_oomkills(kube, core, ns, real):
    kube.apply([_pod(real, "hog", "exec dd if=/dev/zero of=/dev/null bs=96M count=1", memory="32Mi")],
               namespace=ns)

    def terminated():
        p = core.read_namespaced_pod("hog", ns)
        st = (p.status.container_statuses or [None])[0]
        return st and st.state.terminated

    t = wait_for(terminated, timeout=60, what="hog terminated")
    assert t.reason == "OOMKilled", t


def test_the_sandbox_image_is_kept_in_use_by_a_static_pod(kube, core, real):
    """The pause image exists only on this machine; containerd 1.6 does not pin it, so the kubelet would delete
    it under DiskPressure like any unused image and no pod could start again. A static pod runs it: the kubelet
    removes only images no container runs and never evicts a static pod."""
    from localcluster.node import IMAGE_KEEPER, pause_image

    name = f"{IMAGE_KEEPER}-{real['node']}"  # the mirror pod of the node's static pod
    mirror = wait_for(lambda: _running(core, "kube-system", name), timeout=60, what="the image keeper Running")
    assert (mirror.metadata.annotations or {}).get("kubernetes.io/config.source") == "file", mirror.metadata
    assert mirror.spec.node_name == real["node"] and mirror.spec.priority_class_name == "system-node-critical"
    assert mirror.spec.containers[0].image == pause_image()[0]
    assert mirror.status.container_statuses[0].state.running, mirror.status.container_statuses


def test_deleted_pod_leaves_no_container_netns_or_mount(kube, core, ns, real):
    from localcluster import node

    def netns_mounts():
        return {ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                if "/netns/" in ln.split()[4] and ln.split()[4].startswith(str(node.STATE))}

    before = netns_mounts()
    kube.apply([_pod(real, "gone", "exec sleep 3600")], namespace=ns)
    p = wait_for(lambda: _running(core, ns, "gone"), timeout=60, what="pod Running")
    cid = p.status.container_statuses[0].container_id.split("://", 1)[1]
    mine = netns_mounts() - before
    assert mine, "no netns mount for the new pod's sandbox"
    assert cid in _ctr("containers", "ls", "-q")
    assert any(cid in ln for ln in Path("/proc/self/mountinfo").read_text().splitlines())
    core.delete_namespaced_pod("gone", ns, grace_period_seconds=0)

    def gone_everywhere():
        from kubernetes.client.rest import ApiException

        try:
            core.read_namespaced_pod("gone", ns)
            return False
        except ApiException as e:
            if e.status != 404:
                raise
        return (cid not in _ctr("containers", "ls", "-q") and not (mine & netns_mounts())
                and not any(cid in ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()))

    wait_for(gone_everywhere, timeout=60, what="pod, container, netns and mounts gone")


def _ctr(*args) -> str:
    from localcluster import node

    return subprocess.run(["ctr", "--address", str(node.SOCK), "-n", "k8s.io", *args], capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture
def outside():
    """A stand-in for "the outside": a network namespace of this test's own behind a veth pair (eot0, host side
    198.51.100.254; inside 198.51.100.1 with a listener on :80). Without the guards a pod's packet or a Service
    DNATed to that address would go there; with them nothing arrives. Nothing here leaves the machine either."""
    ns, made_run_netns = "embedops-t-out", not os.path.exists("/run/netns")

    def sh(*argv, check=True):
        return subprocess.run(argv, capture_output=True, text=True, check=check)

    sh("ip", "netns", "add", ns)
    listener = None
    try:
        sh("ip", "link", "add", "eot0", "type", "veth", "peer", "name", "eot1")
        sh("ip", "link", "set", "eot1", "netns", ns)
        sh("ip", "addr", "add", "198.51.100.254/24", "dev", "eot0")
        sh("ip", "link", "set", "eot0", "up")
        for argv in (("ip", "addr", "add", "198.51.100.1/24", "dev", "eot1"), ("ip", "link", "set", "eot1", "up"),
                     ("ip", "link", "set", "lo", "up"), ("ip", "route", "add", "default", "via", "198.51.100.254")):
            sh("ip", "netns", "exec", ns, *argv)
        listener = subprocess.Popen(["ip", "netns", "exec", ns, "busybox", "nc", "-ll", "-p", "80", "-e", "busybox",
                                     "echo", "leaked"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the listener answers the host (local traffic, not forwarded): what the pods below cannot reach
        assert wait_for(lambda: _try(lambda: _tcp_read("198.51.100.1", 80, timeout=2)), timeout=10,
                        what="outside listener") == b"leaked\n"
        yield "198.51.100.1"
    finally:
        if listener:
            listener.kill()
            listener.wait()
        sh("ip", "link", "del", "eot0", check=False)
        sh("ip", "netns", "del", ns, check=False)
        if made_run_netns:  # `ip netns add` made /run/netns a bind mount of itself
            sh("umount", "/run/netns", check=False)
            with contextlib.suppress(OSError):
                os.rmdir("/run/netns")


def _guard_drops() -> int:
    out = subprocess.run(["iptables", "-t", "mangle", "-L", "-v", "-x", "-n"], capture_output=True, text=True).stdout
    total, chain = 0, None
    for line in out.splitlines():
        if line.startswith("Chain "):
            chain = line.split()[1]
        elif chain and chain.startswith("EMBEDOPS-") and " DROP " in f" {line} ":
            total += int(line.split()[0])
    return total


def test_nothing_leaves_through_another_interface(kube, core, ns, real, outside):
    kube.apply([_pod(real, "probe", "exec sleep 3600"),
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ext"},
                 "spec": {"ports": [{"port": 80, "targetPort": 80}]}},
                # an EndpointSlice that points a Service at the "outside" address
                {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                 "metadata": {"name": "ext-1", "labels": {"kubernetes.io/service-name": "ext"}},
                 "addressType": "IPv4", "ports": [{"port": 80, "protocol": "TCP", "name": ""}],
                 "endpoints": [{"addresses": [outside], "conditions": {"ready": True}}]}], namespace=ns)
    wait_for(lambda: _running(core, ns, "probe"), timeout=60, what="probe Running")
    ip = core.read_namespaced_service("ext", ns).spec.cluster_ip
    wait_for(lambda: ip in subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout,
             timeout=30, what="kube-proxy's rules for the ext Service")
    drops = _guard_drops()
    # a pod straight to the outside address: forwarded off the bridge -> dropped
    p = _kubectl(kube, "-n", ns, "exec", "probe", "--", "nc", "-w", "2", outside, "80", check=False)
    assert "leaked" not in p.stdout
    # a pod to a Service whose endpoint is outside: DNATed, then dropped the same way
    p = _kubectl(kube, "-n", ns, "exec", "probe", "--", "nc", "-w", "2", ip, "80", check=False)
    assert "leaked" not in p.stdout
    # the host to that Service: DNATed in OUTPUT, dropped in POSTROUTING (EMBEDOPS-OUT)
    assert _try(lambda: _tcp_read(ip, 80, timeout=2)) in (None, b"")
    assert _guard_drops() > drops


def test_kwok_pod_addresses_are_a_blackhole(kube, core, ns, real):
    kube.apply([{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fake", "labels": {"app": "fake"}},
                 "spec": {"nodeSelector": {"kubernetes.io/hostname": "cpu-plain-0"},
                          "containers": [{"name": "c", "image": "registry.invalid/none:0"}]}},
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "fake"},
                 "spec": {"selector": {"app": "fake"}, "ports": [{"port": 80}]}}], namespace=ns)
    pod = wait_for(lambda: _running(core, ns, "fake"), timeout=60, what="kwok pod Running")
    assert pod.status.pod_ip.startswith("10.244.")
    r = subprocess.run(["ip", "route", "get", pod.status.pod_ip], capture_output=True, text=True)
    assert r.returncode != 0 or "blackhole" in r.stdout  # never via eth0
    ip = core.read_namespaced_service("fake", ns).spec.cluster_ip
    wait_for(lambda: ip in subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout,
             timeout=30, what="kube-proxy's rules for the fake Service")
    with pytest.raises(OSError):
        _tcp_read(ip, 80, timeout=2)


def test_second_owner_is_refused(kube, real, tmp_path):
    from localcluster import node

    other = node.RealNode(tmp_path / "other")
    try:
        with pytest.raises(node.RealNodeInUse, match="in use by"):
            other.prepare()
    except BaseException:
        other.down()  # it took the node after all: give it back, or every later run finds it "in use"
        raise


def test_z_down_leaves_nothing_then_back(kube, real):
    """Last in this module: the session's real node down, the machine checked against the record's
    before-state, then the node brought back for the tests after this one."""
    from kubernetes import config

    from localcluster import controlplane, node
    from tests.conftest import session_run_dir

    cluster = controlplane.Cluster(run_dir=session_run_dir(), real_node=True)
    rec = node.RealNode.record()
    assert rec and rec["owner"] == str(cluster._node().run_dir)
    assert "kube-router" in [p["name"] for p in rec["procs"]]
    assert node._run("iptables", "-S", "KUBE-ROUTER-FORWARD", check=False).returncode == 0  # its chains, to remove
    assert cluster._node().down() == []
    assert node.leftovers(rec) == []
    # back, as the session had it
    n = cluster._node()
    st = json.loads(cluster.state_file.read_text())
    n.prepare(int(st["server"].rsplit(":", 1)[1]))
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        n.up(st["server"], cluster.run_dir / "pki", api)
    finally:
        api.close()
    kube.import_images([node.busybox_image()[1]])
