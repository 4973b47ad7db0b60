"""A local upstream Kubernetes control plane for tests and the demo.

Starts etcd, kube-apiserver (RBAC, service-account tokens, self-signed serving cert, loopback only,
random free ports), kube-controller-manager, kube-scheduler and kwok (a fake kubelet for the nodes
annotated ``kwok.x-k8s.io/node=fake``), writes an admin kubeconfig, waits until healthy and creates
three simulated nodes:

* ``gpu-h100-0``: ``nvidia.com/mig-1g.10gb: 7`` with the labels GPU feature discovery sets and the
  ``nvidia.com/gpu=present:NoSchedule`` taint,
* ``cpu-amx-0``: Node Feature Discovery AMX/VNNI/AVX-512 labels,
* ``cpu-plain-0``: no special labels.

With ``real_node=True`` (CLI ``up --real-node``) it also runs ``cpu-real-0``, a real node (kubelet,
kube-proxy, kube-router for NetworkPolicy, containerd, CNI bridge, CoreDNS; ``localcluster/node.py``): the API
server then binds and advertises 10.245.0.1 (the node's bridge) so pods reach it through the ``kubernetes``
Service.

Everything it starts is recorded (PIDs) in ``<run-dir>/state.json`` and stopped by PID.
Binaries come from ``localcluster/build.py`` (``make cluster-binaries``).

CLI::

    python -m localcluster.controlplane up     # start (or reuse a healthy running one); prints KUBECONFIG
    python -m localcluster.controlplane up --real-node   # ... plus the real node cpu-real-0
    python -m localcluster.controlplane env    # prints `export KUBECONFIG=...`
    python -m localcluster.controlplane down   # stop everything it started
    python -m localcluster.controlplane release-node   # stop the cluster that holds the real node, whoever's

Fault tests stop and start single components in place (same ports, same etcd data):
``Cluster.stop_component("kube-apiserver")`` / ``start_component("kube-apiserver")`` (also ``etcd``).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .components import provided
from .pki import free_port, make_client_cert, make_pki, write_kubeconfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def default_run_dir() -> Path:
    return Path(os.environ.get("EMBEDOPS_CLUSTER_DIR", REPO / ".run"))


@dataclass
class Binaries:
    apiserver: Path
    controller_manager: Path
    scheduler: Path
    kwok: Path
    kwok_stages: Path
    etcd: Path
    helm: Path

    @classmethod
    def from_cache(cls) -> "Binaries":
        bins = cls(
            apiserver=provided("k8s", "kube-apiserver"),
            controller_manager=provided("k8s", "kube-controller-manager"),
            scheduler=provided("k8s", "kube-scheduler"),
            kwok=provided("kwok"),
            kwok_stages=provided("kwok", "stages"),
            etcd=provided("etcd"),
            helm=provided("helm"),
        )
        missing = [str(p) for p in (bins.apiserver, bins.controller_manager, bins.scheduler,
                                    bins.kwok, bins.etcd) if not os.access(p, os.X_OK)]
        if missing:
            raise RuntimeError(
                "control plane binaries missing (run `make cluster-binaries` / python -m localcluster.build): "
                + ", ".join(missing))
        return bins


GPU_LABELS = {
    # What NVIDIA GPU feature discovery (gpu-operator) publishes for an H100-80GB in MIG "mixed" mode.
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.family": "hopper",
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/mig.capable": "true",
    "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/mig.config": "all-1g.10gb",
    "nvidia.com/mig.config.state": "success",
    "nvidia.com/mig-1g.10gb.count": "7",
    "nvidia.com/mig-1g.10gb.memory": "9984",
    "nvidia.com/mig-1g.10gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
    "nvidia.com/mig-1g.10gb.slices.gi": "1",
    "nvidia.com/mig-1g.10gb.slices.ci": "1",
    "nvidia.com/mig-1g.10gb.engines.copy": "1",
    "nvidia.com/mig-1g.10gb.multiprocessors": "16",
    "feature.node.kubernetes.io/pci-10de.present": "true",
}
AMX_LABELS = {
    # Node Feature Discovery's cpuid labels on a Sapphire Rapids (or newer) Xeon.
    "feature.node.kubernetes.io/cpu-cpuid.AMXINT8": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AMXBF16": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AVX512BF16": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AVX512BW": "true",
    "feature.node.kubernetes.io/cpu-model.vendor_id": "Intel",
}
PLAIN_LABELS = {
    "feature.node.kubernetes.io/cpu-cpuid.AVX2": "true",
    "feature.node.kubernetes.io/cpu-model.vendor_id": "AMD",
}


def node_manifests() -> list[dict]:
    def node(name, labels, capacity, taints=()):
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                           "kubernetes.io/arch": "amd64", "type": "kwok", **labels},
            },
            "spec": {"taints": list(taints)},
            "status": {"capacity": capacity, "allocatable": capacity},
        }
    gpu_cap = {"cpu": "96", "memory": "1536Gi", "pods": "110", "ephemeral-storage": "1Ti",
               "nvidia.com/mig-1g.10gb": "7"}
    cpu_cap = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "500Gi"}
    return [
        node("gpu-h100-0", GPU_LABELS, gpu_cap,
             [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
        node("cpu-amx-0", AMX_LABELS, cpu_cap),
        node("cpu-plain-0", PLAIN_LABELS, {**cpu_cap, "cpu": "16", "memory": "64Gi"}),
    ]


def _node_step(fn, *args, **kwargs):
    """Run a real-node step; its failures become RealNodeError (one line), so callers can go on without it."""
    from localcluster.node import NodeProcessExited, RealNodeError

    try:
        return fn(*args, **kwargs)
    except RealNodeError:
        raise
    except NodeProcessExited as e:
        # the dead process's last log lines, on the one line: they are all a CI report keeps of why
        raise RealNodeError(f"{type(e).__name__}: " + " | ".join(str(e).strip().splitlines())[:3000]) from e
    except Exception as e:  # noqa: BLE001 - reported as the reason the cluster has no real node
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RealNodeError(f"{type(e).__name__}: {msg}"[:400]) from e


@dataclass(frozen=True)
class Ports:
    """The control plane's local ports, free ones chosen at each start."""
    etcd: int
    etcd_peer: int
    api: int
    controller_manager: int
    scheduler: int
    kwok: int


def _node_ip() -> str:
    """The real node's address on its bridge (imported only where a real node is started)."""
    from localcluster.node import HOST_IP

    return HOST_IP


@dataclass
class Cluster:
    run_dir: Path = field(default_factory=default_run_dir)
    # Also run the real node cpu-real-0 (localcluster/node.py). None: whatever the run dir has (status/env).
    real_node: bool | None = False

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "state.json"

    # --- state ---------------------------------------------------------------------------------
    def read_state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def save_state(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    @staticmethod
    def _alive(proc: dict) -> bool:
        try:
            cmdline = Path(f"/proc/{proc['pid']}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return False
        stat = Path(f"/proc/{proc['pid']}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        return cmdline == proc["argv0"]

    def running(self) -> bool:
        st = self.read_state()
        if not (bool(st.get("procs")) and all(self._alive(p) for p in st["procs"]) and self._readyz(st)):
            return False
        if self.real_node is not None and bool(st.get("real_node")) != bool(self.real_node):
            return False
        if st.get("real_node"):
            from localcluster import node as realnode

            rec = realnode.RealNode.record()
            return bool(rec) and rec.get("owner") == str(self._node().run_dir) and all(
                realnode.process_alive(p) for p in rec.get("procs", []))
        return True

    def _node(self):
        from localcluster.node import RealNode

        return RealNode(self.run_dir)

    # --- health --------------------------------------------------------------------------------
    def _ssl(self) -> ssl.SSLContext:
        pki = self.run_dir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    def _readyz(self, st: dict) -> bool:
        try:
            with urllib.request.urlopen(st["server"] + "/readyz", context=self._ssl(), timeout=3) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, KeyError, ssl.SSLError, http.client.HTTPException):
            return False

    # --- lifecycle -----------------------------------------------------------------------------
    def spawn(self, state: dict, name: str, argv: list[str]) -> None:
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=self.run_dir)
        log.close()
        state["procs"].append({"name": name, "pid": p.pid, "argv0": argv[0], "argv": argv})
        self.save_state(state)

    def exit_status(self, proc: dict) -> str | None:
        """None while ``proc`` runs, else how it ended ('exited 2', 'was killed by SIGKILL'). The harness is
        the parent of what it started, so the kernel's own answer (waitpid) decides; /proc is read only for a
        process another harness started. (/proc/PID/cmdline alone once called a live etcd dead in CI, and the
        clean-up then stopped it.)"""
        try:
            pid, status = os.waitpid(proc["pid"], os.WNOHANG)
        except ChildProcessError:  # not ours (another process's harness), or reaped already
            return None if self._alive(proc) else "exited"
        if not pid:
            return None
        if os.WIFSIGNALED(status):
            return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        return f"exited {os.WEXITSTATUS(status)}"

    def _death(self, proc: dict, how: str) -> str:
        """'etcd exited 2: <its last log line>' or 'etcd was killed by SIGKILL (log empty)': a kill from
        outside (the OOM killer, a stray clean-up) told apart from a crash."""
        try:
            lines = (self.run_dir / "logs" / f"{proc['name']}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return f"{proc['name']} {how}" + (f": {lines[-1][:300]}" if lines else " (log empty)")

    def _wait(self, what: str, ok, timeout: float, state: dict) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            dead = [(p, how) for p in state["procs"] if (how := self.exit_status(p)) is not None]
            if dead:
                raise RuntimeError(f"{'; '.join(self._death(p, how) for p, how in dead)} while waiting for "
                                   f"{what}; see {self.run_dir / 'logs'}")
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; see {self.run_dir / 'logs'}")

    def up(self, timeout: float = 180) -> Path:
        """Start the control plane (or reuse a healthy one started from this run dir): etcd, the API server, the
        controller manager and scheduler, kwok and its simulated nodes, then the real node when there is one."""
        if self.running():
            return self.kubeconfig
        self.down(quiet=True)
        bins = Binaries.from_cache()
        t0 = time.monotonic()
        rd = self.run_dir
        rd.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(rd / "etcd-data", ignore_errors=True)
        shutil.rmtree(rd / "logs", ignore_errors=True)
        (rd / "logs").mkdir()
        ports = Ports(*(free_port() for _ in range(6)))
        node = None
        if self.real_node:
            from localcluster.node import NodeBinaries
            NodeBinaries.from_cache()
            node = self._node()
            # bridge, routes, guards (one keeps the API server's port to lo and the bridge): before it listens
            _node_step(node.prepare, ports.api)
        pki = self._pki(with_node_ip=node is not None)
        # Host clients (kubeconfig, the node's own components) always use 127.0.0.1: nothing on the host ever
        # depends on the bridge address, so none of it can be routed off the machine once the bridge is gone.
        server = f"https://127.0.0.1:{ports.api}"
        state: dict = {"server": server, "procs": [], "started": time.time(), "real_node": bool(node)}
        self.save_state(state)
        write_kubeconfig(self.kubeconfig, server, pki)
        try:
            self._start_etcd(state, bins, ports, timeout)
            self._start_apiserver(state, bins, ports, pki, node is not None, timeout)
            t_api = time.monotonic() - t0
            self._start_controllers(state, bins, ports, pki)
            self._start_kwok(state, bins, ports)
            self._bootstrap(state, timeout)
            t_cp = time.monotonic() - t0
            if node:
                self._start_real_node(state, node, server, pki, timeout)
        except BaseException:
            self.down(quiet=True)
            raise
        state["ready_seconds"] = round(time.monotonic() - t0, 1)
        state["control_plane_seconds"] = round(t_cp, 1)
        state["apiserver_seconds"] = round(t_api, 1)
        self.save_state(state)
        return self.kubeconfig

    def _pki(self, with_node_ip: bool) -> Path:
        pki = self.run_dir / "pki"
        make_pki(pki, (_node_ip(),) if with_node_ip else ())
        # the aggregation layer's front proxy: the API server's client certificate towards aggregated API
        # servers (KEDA's metrics adapter), which trust the identity headers it sends (--requestheader-*)
        make_client_cert(pki, pki, "front-proxy-client", "/CN=front-proxy-client")
        # the controller manager as kubeadm (and so kind) runs it: its own user, each controller under its own
        # service account (--use-service-account-credentials), so what a controller writes is checked as that
        # controller (the chart's reserved-labels policy admits pods the ReplicaSet and Job controllers make)
        make_client_cert(pki, pki, "kube-controller-manager", "/CN=system:kube-controller-manager")
        return pki

    def _start_etcd(self, state: dict, bins: Binaries, ports: Ports, timeout: float) -> None:
        self.spawn(state, "etcd", [
            str(bins.etcd), "--name=embedops", f"--data-dir={self.run_dir / 'etcd-data'}",
            f"--listen-client-urls=http://127.0.0.1:{ports.etcd}",
            f"--advertise-client-urls=http://127.0.0.1:{ports.etcd}",
            f"--listen-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
            f"--initial-cluster=embedops=http://127.0.0.1:{ports.etcd_peer}",
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=4294967296",
        ])
        # the API server gives up on a store that does not answer within seconds ("error creating storage
        # factory: context deadline exceeded"); on a loaded machine etcd's start can take longer than that
        self._wait("etcd /health", lambda: self._etcd_healthy(f"http://127.0.0.1:{ports.etcd}"), timeout, state)

    def _start_apiserver(self, state: dict, bins: Binaries, ports: Ports, pki: Path, node: bool,
                         timeout: float) -> None:
        self.spawn(state, "kube-apiserver", [
            str(bins.apiserver),
            f"--etcd-servers=http://127.0.0.1:{ports.etcd}",
            # with the real node it listens on all addresses (pods come in on 10.245.0.1, the advertised address;
            # node.py's EMBEDOPS-IN guard drops the port on any other interface than lo and the bridge)
            f"--bind-address={'0.0.0.0' if node else '127.0.0.1'}",
            f"--advertise-address={_node_ip() if node else '127.0.0.1'}", f"--secure-port={ports.api}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            # with the real node, the `kubernetes` Service points at the API server on the bridge (pods'
            # in-cluster config); without, nothing could reach it
            "--endpoint-reconciler-type=" + ("lease" if node else "none"),
            *([f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
               f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
               f"--kubelet-certificate-authority={pki / 'ca.crt'}",
               # logs/exec: the node's IP, never its name through the machine's resolver
               "--kubelet-preferred-address-types=InternalIP"] if node else []),
            f"--cert-dir={self.run_dir / 'apiserver-certs'}",
            f"--requestheader-client-ca-file={pki / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            # to an aggregated API server's endpoint (a pod on the bridge), not its Service's cluster IP
            "--enable-aggregator-routing=true",
            "--v=1",
        ])
        self._wait("kube-apiserver /readyz", lambda: self._readyz(state), timeout, state)

    def _start_controllers(self, state: dict, bins: Binaries, ports: Ports, pki: Path) -> None:
        kc = str(self.kubeconfig)
        kcm = self.run_dir / "kube-controller-manager.kubeconfig"
        write_kubeconfig(kcm, state["server"], pki, cert="kube-controller-manager")
        self.spawn(state, "kube-controller-manager", [
            str(bins.controller_manager), f"--kubeconfig={kcm}",
            f"--authentication-kubeconfig={kcm}", f"--authorization-kubeconfig={kcm}",
            "--use-service-account-credentials=true",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={ports.controller_manager}",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--service-cluster-ip-range=10.96.0.0/16", "--controllers=*",
            # kwok renews the fake nodes' leases; on a loaded 2-core machine a renewal can come late and the
            # default 50 s grace then taints every node not-ready/unreachable, so nothing schedules (seen
            # in e2e: "3 node(s) had untolerated taint(s)", with etcd 3.5.1, whose missing watch progress
            # made kwok's lease updates fail on conflicts for tens of seconds). A fake node's health is
            # not under test.
            "--node-monitor-grace-period=300s",
            f"--cert-dir={self.run_dir / 'kcm-certs'}", "--v=1",
        ])
        self.spawn(state, "kube-scheduler", [
            str(bins.scheduler), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={ports.scheduler}",
            f"--cert-dir={self.run_dir / 'scheduler-certs'}", "--v=1",
        ])

    def _start_kwok(self, state: dict, bins: Binaries, ports: Ports) -> None:
        stages = sorted(bins.kwok_stages.glob("*.yaml"))
        kwok_cfg = self.run_dir / "kwok.yaml"
        kwok_cfg.write_text("\n---\n".join(p.read_text() for p in stages))
        self.spawn(state, "kwok", [
            str(bins.kwok), f"--kubeconfig={self.kubeconfig}", f"--config={kwok_cfg}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--server-address=127.0.0.1:{ports.kwok}",
            "--node-ip=127.0.0.1", "--cidr=10.244.0.0/16", "--node-lease-duration-seconds=40",
        ])

    def _start_real_node(self, state: dict, node, server: str, pki: Path, timeout: float) -> None:
        from kubernetes import config

        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        try:
            _node_step(node.up, server, pki, api, timeout=timeout)
        finally:
            api.close()
        state["real_node_ready_seconds"] = node.ready_seconds
        state["real_node_up_seconds"] = node.up_seconds

    def _bootstrap(self, state: dict, timeout: float) -> None:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException

        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        core = client.CoreV1Api(api)
        for n in node_manifests():
            try:
                core.create_node(n)
            except ApiException as e:
                if e.status != 409:
                    raise
            core.patch_node_status(n["metadata"]["name"], {"status": n["status"]})

        def nodes_ready() -> bool:
            # Ready, and the node lifecycle controller has also lifted the not-ready taint it put on the new
            # node (it lags the condition by a moment; until then nothing without a toleration schedules).
            items = core.list_node(label_selector="type=kwok").items
            ready = [n for n in items if any(c.type == "Ready" and c.status == "True"
                                             for c in (n.status.conditions or []))
                     and not any(t.key.startswith("node.kubernetes.io/") for t in (n.spec.taints or []))]
            return len(ready) == len(node_manifests())

        def default_sa() -> bool:
            try:
                core.read_namespaced_service_account("default", "default")
                return True
            except ApiException:
                return False

        self._wait("kwok nodes Ready", nodes_ready, timeout, state)
        self._wait("default ServiceAccount (controller-manager)", default_sa, timeout, state)
        api.close()

    def down(self, quiet: bool = False) -> None:
        """Stop every process this harness started (by PID, newest first); no orphans. The real node (when
        this run dir owns it) goes first, with everything it recorded."""
        st = self.read_state()
        from localcluster import node as realnode

        rec = realnode.RealNode.record()
        owns_node = bool(rec) and rec.get("owner") == str(self._node().run_dir)
        if owns_node:
            self._node().stop()  # its processes and pods; the network after the control plane
        procs = st.get("procs", [])
        # etcd last: the API server's lease endpoint reconciler removes its lease on the way out
        self.stop_processes([p for p in reversed(procs) if p["name"] != "etcd"])
        self.stop_processes([p for p in procs if p["name"] == "etcd"])
        if owns_node:
            left = self._node().down()
            if left:
                print(f"real node: could not remove: {'; '.join(left)}", file=sys.stderr)
            elif not quiet:
                print(f"stopped: real node {realnode.NODE_NAME}")
        if procs and not quiet:
            print(f"stopped: {', '.join(p['name'] + '(' + str(p['pid']) + ')' for p in procs)}")
        if self.state_file.exists():
            self.state_file.unlink()
        shutil.rmtree(self.run_dir / "etcd-data", ignore_errors=True)

    # --- single components (fault tests) --------------------------------------------------------
    def _proc(self, name: str) -> tuple[dict, dict]:
        st = self.read_state()
        for p in st.get("procs", []):
            if p["name"] == name:
                return st, p
        raise KeyError(f"no {name} in {self.state_file} (components: "
                       f"{[p['name'] for p in st.get('procs', [])]})")

    def stop_component(self, name: str, kill: bool = False) -> None:
        """Stop one component (``etcd``, ``kube-apiserver``, ``kube-controller-manager``, ``kube-scheduler``,
        ``kwok``) by its PID: TERM (KILL after 15 s), or KILL at once. Its ports, data dir and argv stay
        recorded, so ``start_component`` brings back the same thing."""
        _, p = self._proc(name)
        if kill and self._alive(p):
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop_processes([p])

    def start_component(self, name: str, timeout: float = 120) -> float:
        """Start a component stopped by ``stop_component`` again with the same argv (same ports, same etcd
        data), and wait until it serves: etcd's /health, the API server's /readyz (after etcd: the API
        server's own readiness covers its etcd connection). Returns the seconds it took."""
        st, p = self._proc(name)
        t0 = time.monotonic()
        if not self._alive(p):
            if "argv" not in p:
                raise RuntimeError(f"{name} was started by an older harness (no argv recorded); restart the cluster")
            log = open(self.run_dir / "logs" / f"{name}.log", "ab")
            proc = subprocess.Popen(p["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=self.run_dir)
            log.close()
            p["pid"] = proc.pid
            self.save_state(st)
        if name == "etcd":
            url = next(a.split("=", 1)[1] for a in p["argv"] if a.startswith("--listen-client-urls="))
            self._wait("etcd /health", lambda: self._etcd_healthy(url), timeout, st)
        if name in ("etcd", "kube-apiserver"):
            self._wait("kube-apiserver /readyz", lambda: self._readyz(st), timeout, st)
        return time.monotonic() - t0

    def restart_controllers(self) -> float:
        """After an API server outage: restart the controller-manager, the scheduler and kwok, as a cluster that
        runs them with leader election (the default) does: gone for longer than their renewDeadline (10 s), they
        exit and the kubelet starts them again. Here they run without it (--leader-elect=false) and would stay up
        with their informers in client-go's reflector back-off instead, acting on nothing new for up to a minute
        after a 20 s outage (measured: a fleet's Deployments available 61 s after the API server was back, 15 s
        with this). Returns the seconds it took."""
        t0 = time.monotonic()
        names = [p["name"] for p in self.read_state().get("procs", [])
                 if p["name"] in ("kube-controller-manager", "kube-scheduler", "kwok")]
        for name in names:
            self.stop_component(name)
        for name in names:
            self.start_component(name)
        return time.monotonic() - t0

    @staticmethod
    def _etcd_healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url.split(",")[0] + "/health", timeout=3) as r:
                return json.loads(r.read()).get("health") == "true"
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            # a starting etcd serves HTTP and gRPC on one port: an early request can get a malformed answer
            return False

    def stop_processes(self, procs: list[dict]) -> None:
        """TERM, then KILL after 15 s; by PID, checked against argv0 first."""
        for p in procs:
            if self._alive(p):
                try:
                    os.kill(p["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for p in procs:
            while self._alive(p) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._alive(p):
                try:
                    os.kill(p["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # reap if it is our child (CLI `up` processes are reparented to init)
            try:
                os.waitpid(p["pid"], os.WNOHANG)
            except ChildProcessError:
                pass


def start_cluster(run_dir: Path, timeout: float = 180) -> tuple["Cluster", Path, str | None]:
    """Start (or reuse) the control plane in ``run_dir`` with the real node when this machine allows one,
    else without it: (cluster, kubeconfig, why there is no real node or None). ``EMBEDOPS_REAL_NODE=0`` asks
    for none. Used by the tests' ``kube`` fixture and the demo."""
    from localcluster import node

    if os.environ.get("EMBEDOPS_REAL_NODE", "1") == "0":
        reason: str | None = "EMBEDOPS_REAL_NODE=0"
    else:
        reason = node.preflight()
        if not reason:
            try:
                node.NodeBinaries.from_cache()
            except node.RealNodeError as e:
                reason = str(e)
    cluster = Cluster(run_dir=run_dir, real_node=reason is None)
    try:
        kubeconfig = cluster.up(timeout=timeout)
    except node.RealNodeError as e:
        reason = str(e)
        print(f"running without the real node: {reason}", file=sys.stderr)
        cluster = Cluster(run_dir=run_dir, real_node=False)
        kubeconfig = cluster.up(timeout=timeout)
    return cluster, kubeconfig, reason


def release_node() -> int:
    """Stop whichever cluster holds the machine's real node (its ``down``: node, then control plane), e.g. one
    a killed session left running that a new session or CI would otherwise find "in use"; then remove what the
    node's record still lists."""
    from localcluster import node

    rec = node.RealNode.record()
    if rec:
        Cluster(run_dir=Path(rec["owner"]), real_node=None).down()
    problems = node.remove_leftovers()
    if problems:
        print("could not remove: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(node.status())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else "up"
    real = "--real-node" in argv[1:]
    c = Cluster(real_node=real if cmd == "up" else None)
    if cmd == "up":
        from localcluster.node import RealNodeError

        t = time.monotonic()
        try:
            kc = c.up()
        except RealNodeError as e:
            print(f"harness: real node: {e}", file=sys.stderr)
            return 1
        st = c.read_state()
        print(f"control plane up in {time.monotonic() - t:.1f}s "
              f"(kube-apiserver ready after {st.get('apiserver_seconds', '?')}s): {st['server']}")
        if st.get("real_node"):
            print(f"real node cpu-real-0 Ready {st.get('real_node_ready_seconds', '?')}s after its kubelet "
                  f"started (node start-up {st.get('real_node_up_seconds', '?')}s, after the control plane's "
                  f"{st.get('control_plane_seconds', '?')}s)")
        print(f"export KUBECONFIG={kc}")
        return 0
    if cmd == "env":
        if not c.running():
            print("not running; start it with: python -m localcluster.controlplane up", file=sys.stderr)
            return 1
        print(f"export KUBECONFIG={c.kubeconfig}")
        return 0
    if cmd == "down":
        c.down()
        return 0
    if cmd == "status":
        print("running" if c.running() else "stopped")
        return 0
    if cmd == "release-node":
        return release_node()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
