"""A real node for the local control plane: ``cpu-real-0``, run by a real kubelet and kube-proxy on this machine.

containerd (Debian's, with runc) runs the pods; the CNI bridge plugin puts them on ``embedops0``
(10.245.0.0/24, the host is 10.245.0.1); kube-proxy (iptables mode) implements Services (10.96.0.0/16);
CoreDNS (``localcluster/recipes/coredns``, kubernetes plugin only, no forwarding) answers ``cluster.local`` on
10.245.0.1:53; kube-router's firewall controller (only that: no routing, no service proxy) enforces NetworkPolicy
for the node's pods with iptables and ipsets. The kwok nodes of the same cluster keep running no containers.

Traffic never leaves the machine: before anything starts, the pod and Service ranges are routed to the
bridge, kwok's fake pod range (10.244.0.0/16) is a blackhole route, and two guard chains in the ``mangle``
table (ahead of anything kube-proxy adds to ``filter``/``nat``) drop every forwarded packet that is not
bridge-to-bridge and every packet first addressed to a pod/Service/kwok address that would leave through
another interface than the bridge or loopback. The CNI config has no ipMasq and no portmap.

Everything created is written to a machine-wide record (``/run/embedops/node/record.json``) *before* it is
created: processes (PID, argv0, start time), interfaces, routes, iptables chains and rules, nft tables, ipsets,
cgroup dirs, sysctls with their old values, dirs outside the run dir. ``down()`` removes exactly that;
``up()`` first removes what a crashed or killed previous owner left. One real node per machine: a second
owner gets ``RealNodeInUse`` ("in use by <run dir>").
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "cpu-real-0"
BRIDGE = "embedops0"
HOST_IP = "10.245.0.1"
POD_CIDR = "10.245.0.0/24"
SERVICE_CIDR = "10.96.0.0/16"
KWOK_POD_CIDR = "10.244.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
DNS_IP = HOST_IP
REAL_NODE_LABEL = "embedops.dev/real-node"
# The node is tainted so that only pods meant for it (toleration + nodeSelector) land there: a pod of the
# kwok-based tests would otherwise try to pull its made-up image here. EMBEDOPS_REAL_NODE_TAINT=0: no taint.
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
NO_PROXY_URL = "http://127.0.0.1:9"
GUARD_FWD = "EMBEDOPS-FWD"
GUARD_OUT = "EMBEDOPS-OUT"
GUARD_IN = "EMBEDOPS-IN"

# Machine-wide and short (unix socket paths are limited to 108 bytes).
STATE = Path(os.environ.get("EMBEDOPS_NODE_STATE", "/run/embedops/node"))
LOCK = STATE.parent / "node.lock"
RECORD = STATE / "record.json"
SOCK = STATE / "containerd.sock"

# sysctls the node's parts write: the CNI bridge plugin (ip_forward), kubelet (protectKernelDefaults off:
# vm.overcommit_memory, vm.panic_on_oom, kernel.panic, kernel.panic_on_oops, kernel.keys.*), br_netfilter,
# kube-proxy (route_localnet, conntrack: turned off in its config, restored anyway).
SYSCTLS = [
    "net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding", "net/ipv4/conf/default/forwarding",
    "net/ipv4/conf/all/route_localnet", "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables", "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
    "kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
    "net/netfilter/nf_conntrack_max", "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
]
# Paths outside the run dir that kubelet, containerd or libcni create whatever they are configured with
# (hard-coded device-plugin dir, /var/log/containers symlinks, libcni's result cache, the shim sockets).
OUTSIDE_DIRS = [
    "/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/containerd",
    "/var/lib/containerd", "/opt/containerd", "/etc/cni", "/opt/cni", "/run/netns", "/etc/kubernetes",
    "/var/run/netns", "/run/embedops",
]
# Node Feature Discovery's cpuid label names for /proc/cpuinfo flags.
NFD_CPUID = {
    "avx": "AVX", "avx2": "AVX2", "fma": "FMA3", "f16c": "F16C", "avx512f": "AVX512F",
    "avx512bw": "AVX512BW", "avx512cd": "AVX512CD", "avx512dq": "AVX512DQ", "avx512vl": "AVX512VL",
    "avx512_vnni": "AVX512VNNI", "avx512_bf16": "AVX512BF16", "avx512_fp16": "AVX512FP16",
    "avx512ifma": "AVX512IFMA", "avx512vbmi": "AVX512VBMI", "avx512_vbmi2": "AVX512VBMI2",
    "avx512_bitalg": "AVX512BITALG", "avx512_vpopcntdq": "AVX512VPOPCNTDQ", "avx_vnni": "AVXVNNI",
    "amx_tile": "AMXTILE", "amx_bf16": "AMXBF16", "amx_int8": "AMXINT8", "amx_fp16": "AMXFP16",
    "sha_ni": "SHA", "aes": "AESNI", "vaes": "VAES", "vpclmulqdq": "VPCLMULQDQ", "gfni": "GFNI",
    "movdiri": "MOVDIRI", "movdir64b": "MOVDIR64B", "cldemote": "CLDEMOTE", "waitpkg": "WAITPKG",
}
NFD_PREFIX = "feature.node.kubernetes.io/cpu-cpuid."
# Runtime data in <run dir>/node removed on down (logs, configs and certificates stay for reading).
DATA_SUBDIRS = ("containerd", "containerd-opt", "kubelet", "pod-logs")


class RealNodeError(RuntimeError):
    """The real node could not be started; str() is a one-line reason."""


class NodeProcessExited(RuntimeError):
    """A node process (containerd, kubelet, kube-router, ...) exited while the node was coming up."""


class RealNodeUnavailable(RealNodeError):
    """This machine cannot run the real node (package, kernel or privilege missing)."""


class RealNodeInUse(RealNodeError):
    """Another run dir's cluster holds the machine's one real node."""


def nfd_labels(cpuinfo: str | None = None) -> dict[str, str]:
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
            break
    labels = {NFD_PREFIX + name: "true" for flag, name in NFD_CPUID.items() if flag in flags}
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            vendor = line.split(":", 1)[1].strip()
            labels["feature.node.kubernetes.io/cpu-model.vendor_id"] = \
                {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, re.sub(r"[^A-Za-z0-9]", "", vendor))
            break
    return labels


def node_labels() -> dict[str, str]:
    return {REAL_NODE_LABEL: "true", **nfd_labels()}


# --- small helpers -------------------------------------------------------------------------------------
def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), input=input, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: rc={p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


def _sysctl_get(key: str) -> str | None:
    try:
        return Path("/proc/sys", key).read_text().strip()
    except OSError:
        return None


def _sysctl_set(key: str, value: str) -> None:
    Path("/proc/sys", key).write_text(value + "\n")


def _proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return fields[19]  # starttime (field 22)


def _proc_argv0(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return None


def process_alive(p: dict) -> bool:
    return _proc_start(p["pid"]) == p.get("start") and _proc_argv0(p["pid"]) == p["argv0"]


def _mountpoints_under(roots: list[Path]) -> list[str]:
    """Mount points at or under any of roots, newest first (so deeper/later mounts go first)."""
    out = []
    roots_s = [str(r).rstrip("/") for r in roots]
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].encode().decode("unicode_escape")
        if any(mp == r or mp.startswith(r + "/") for r in roots_s):
            out.append(mp)
    return list(reversed(out))


def _umount_all(roots: list[Path]) -> list[str]:
    failed = []
    for _ in range(5):
        mps = _mountpoints_under(roots)
        if not mps:
            return []
        failed = []
        for mp in sorted(set(mps), key=lambda m: (-m.count("/"), m)):
            if _run("umount", mp, check=False).returncode != 0:
                if _run("umount", "-l", mp, check=False).returncode != 0:
                    failed.append(mp)
    return _mountpoints_under(roots)


def _cgroup_hierarchies() -> list[Path]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        sep = parts.index("-")
        if parts[sep + 1] in ("cgroup", "cgroup2"):
            out.append(Path(parts[4]))
    return out


def _iptables_save(cmd: str) -> str:
    p = _run(f"{cmd}-save", check=False)
    return p.stdout if p.returncode == 0 else ""


def _chains_and_rules(save: str) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """{table: {chains}}, {table: ["-A CHAIN ..." rules]} from iptables-save output."""
    chains: dict[str, set[str]] = {}
    rules: dict[str, list[str]] = {}
    table = None
    for line in save.splitlines():
        if line.startswith("*"):
            table = line[1:]
            chains[table], rules[table] = set(), []
        elif line.startswith(":") and table:
            chains[table].add(line[1:].split()[0])
        elif line.startswith("-A ") and table:
            rules[table].append(line)
    return chains, rules


def _ours(chain: str) -> bool:
    return chain.startswith(("KUBE-", "EMBEDOPS-"))


def _kube_router_set(name: str) -> bool:
    """kube-router's ipsets: KUBE-SRC-*/KUBE-DST-* per policy, kube-router-* for the node (inet6: for IPv6)."""
    return name.removeprefix("inet6:").startswith(("KUBE-", "kube-router-"))


def _ipsets() -> list[str]:
    if not shutil.which("ipset"):
        return []
    p = _run("ipset", "list", "-n", check=False)
    return sorted(p.stdout.split()) if p.returncode == 0 else []


def _nft_tables() -> list[str]:
    if not shutil.which("nft"):
        return []
    p = _run("nft", "list", "tables", check=False)
    return [ln.split(None, 1)[1].strip() for ln in p.stdout.splitlines() if ln.startswith("table ")]


@contextlib.contextmanager
def _locked():
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- images --------------------------------------------------------------------------------------------
PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    for (;;) pause();
}
"""
BUSYBOX_APPLETS = ["sh", "nc", "nslookup", "sleep", "cat", "echo", "ls", "ip", "hostname", "head", "dd",
                   "true", "false", "env", "ps", "grep", "wc", "mount", "id", "printf", "tail", "kill"]


def images_dir() -> Path:
    from .components import cache_dir

    return cache_dir() / "node-images"


def _podman_image(name: str, ctx: Path, containerfile: str, out: Path) -> Path:
    """podman build (no network) of ctx into a docker-archive at out; the podman copy is removed again."""
    (ctx / "Containerfile").write_text(containerfile)
    _run("podman", "build", "--network=none", "-q", "-t", name, "-f", str(ctx / "Containerfile"), str(ctx))
    try:
        tmp = out.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        _run("podman", "save", "--format", "docker-archive", "-o", str(tmp), name)
        tmp.replace(out)
    finally:
        _run("podman", "rmi", "-f", name, check=False)
    return out


# The sandbox image exists only here (no registry can give it back). containerd 1.6 (Debian 12) does not report
# it as pinned, so under DiskPressure the kubelet's eviction manager deletes it like any unused image, and from
# then on every new pod on the node stays in ContainerCreating ("failed to pull ... pause"); seen on a machine
# whose disk reached 98%. A static pod that runs the pause binary itself keeps the image in use: the kubelet
# removes only images no container runs, and never evicts a static pod.
IMAGE_KEEPER = "embedops-image-keeper"


def image_keeper_pod(pause_name: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": IMAGE_KEEPER, "namespace": "kube-system",
                     "labels": {"app.kubernetes.io/name": IMAGE_KEEPER}},
        "spec": {"hostNetwork": True, "priorityClassName": "system-node-critical",
                 "containers": [{"name": "pause", "image": pause_name, "imagePullPolicy": "Never",
                                 "resources": {"requests": {"cpu": "1m", "memory": "4Mi"},
                                               "limits": {"memory": "16Mi"}}}]},
    }


def pause_image() -> tuple[str, Path]:
    """The sandbox image: a static C pause() loop, FROM scratch. (name, docker-archive)."""
    h = hashlib.sha256(PAUSE_C.encode()).hexdigest()[:12]
    name = f"localhost/embedops-node/pause:{h}"
    out = images_dir() / f"pause-{h}.tar"
    if out.exists():
        return name, out
    if not shutil.which("gcc") or not shutil.which("podman"):
        raise RealNodeUnavailable("the pause image needs gcc and podman (scripts/host-packages.sh)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as d:
        ctx = Path(d)
        (ctx / "pause.c").write_text(PAUSE_C)
        _run("gcc", "-static", "-Os", "-s", "-o", str(ctx / "pause"), str(ctx / "pause.c"))
        _podman_image(name, ctx, 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n', out)
    return name, out


def busybox_image() -> tuple[str, Path]:
    """A test image: Debian's busybox-static FROM scratch, applets as symlinks. (name, docker-archive)."""
    bb = Path("/bin/busybox")
    if not bb.exists():
        raise RealNodeUnavailable("busybox-static is not installed (scripts/host-packages.sh)")
    ver = _run("dpkg-query", "-W", "-f=${Version}", "busybox-static", check=False).stdout.strip() or "local"
    h = hashlib.sha256((ver + ",".join(BUSYBOX_APPLETS)).encode() + bb.read_bytes()).hexdigest()[:12]
    name = f"localhost/embedops-node/busybox:{h}"
    out = images_dir() / f"busybox-{h}.tar"
    if out.exists():
        return name, out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as d:
        ctx = Path(d)
        (ctx / "bin").mkdir()
        shutil.copy2(bb, ctx / "bin" / "busybox")
        for a in BUSYBOX_APPLETS:
            os.symlink("busybox", ctx / "bin" / a)
        (ctx / "etc").mkdir()
        (ctx / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        (ctx / "etc" / "group").write_text("root:x:0:\nnobody:x:65534:\n")
        _podman_image(name, ctx, 'FROM scratch\nCOPY bin /bin\nCOPY etc /etc\nENV PATH=/bin\nCMD ["/bin/sh"]\n',
                      out)
    return name, out


def import_into_containerd(address: str, archives: list[Path]) -> None:
    for a in archives:
        _run("ctr", "--address", address, "-n", "k8s.io", "images", "import", str(a))


# --- the node ------------------------------------------------------------------------------------------
@dataclass
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    kube_router: Path

    @classmethod
    def from_cache(cls) -> "NodeBinaries":
        from .components import provided

        b = cls(kubelet=provided("k8s", "kubelet"), kube_proxy=provided("k8s", "kube-proxy"),
                coredns=provided("coredns"), kube_router=provided("kube-router"))
        missing = [str(p) for p in (b.kubelet, b.kube_proxy, b.coredns, b.kube_router) if not os.access(p, os.X_OK)]
        if missing:
            raise RealNodeUnavailable("real-node binaries missing (python -m localcluster.build k8s coredns "
                                      "kube-router): "
                                      + ", ".join(missing))
        return b


def preflight() -> str | None:
    """Why this machine cannot run the real node, or None."""
    if os.geteuid() != 0:
        return "the real node needs root (kubelet, containerd, bridge, iptables)"
    for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "iptables-save", "ip",
                 "conntrack", "ipset"):
        if not shutil.which(tool):
            return f"{tool} is not installed (scripts/host-packages.sh)"
    for plugin in ("bridge", "host-local", "loopback"):
        if not Path("/usr/lib/cni", plugin).exists():
            return f"CNI plugin {plugin} missing in /usr/lib/cni (containernetworking-plugins)"
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        return "the kernel has no br_netfilter (net.bridge.bridge-nf-call-iptables missing)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem"
    if not any(h.name == "memory" for h in _cgroup_hierarchies()) and \
            not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "no memory cgroup controller"
    return None


class RealNode:
    """``prepare()`` (network, before the API server binds 10.245.0.1), ``up()`` (after the control plane),
    ``down()``. ``run_dir`` holds its data (containerd root, kubelet root, logs, configs)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir).resolve()
        self.data = self.run_dir / "node"
        self.logs = self.data / "logs"
        self.kubelet_port = 0
        self.ready_seconds: float | None = None
        self.up_seconds: float | None = None
        self._children: dict[int, subprocess.Popen] = {}  # pid -> the process this object spawned (exit status)

    # --- record ----------------------------------------------------------------------------------
    @staticmethod
    def record() -> dict | None:
        try:
            return json.loads(RECORD.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _save(self, rec: dict) -> None:
        STATE.mkdir(parents=True, exist_ok=True)
        tmp = RECORD.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(RECORD)

    @staticmethod
    def owner() -> str | None:
        rec = RealNode.record()
        return rec.get("owner") if rec else None

    @staticmethod
    def _owner_alive(rec: dict) -> bool:
        """The recorded owner still holds the node: the process that made the record is still running (it may be
        between prepare() and its first node process), or a node process is alive and its control plane too."""
        pid, start = rec.get("creator_pid"), rec.get("creator_start")
        if pid and start and _proc_start(pid) == start:
            return True
        if not any(process_alive(p) for p in rec.get("procs", [])):
            return False
        owner = Path(rec.get("owner", ""))
        try:
            st = json.loads((owner / "state.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        return any(_alive_cp(p) for p in st.get("procs", []) if p.get("name") == "kube-apiserver")

    # --- prepare: lock, leftovers, network -------------------------------------------------------
    def prepare(self, api_port: int | None = None) -> None:
        """Lock, leftovers of a previous record, then the network: bridge, routes, guards. With ``api_port``
        the API server may listen on all addresses (pods reach it on 10.245.0.1 through the ``kubernetes``
        Service, host clients on 127.0.0.1): a guard drops that port on every interface but lo and the bridge."""
        reason = preflight()
        if reason:
            raise RealNodeUnavailable(reason)
        with _locked():
            rec = self.record()
            if rec and rec.get("owner") != str(self.run_dir) and self._owner_alive(rec):
                raise RealNodeInUse(f"the real node {NODE_NAME} is in use by {rec['owner']} "
                                    f"(record {RECORD}); stop that cluster first")
            if rec:
                _teardown(rec)
            STATE.mkdir(parents=True, exist_ok=True)
            rec = {"owner": str(self.run_dir), "creator_pid": os.getpid(), "creator_start": _proc_start(os.getpid()),
                   "created": time.time(),
                   "data": str(self.data), "state": str(STATE), "procs": [], "sysctls": {}, "links": [],
                   "routes": [], "iptables": {}, "nft_tables_before": _nft_tables(), "ipsets_before": _ipsets(),
                   "cgroups": [],
                   "outside_dirs": [d for d in OUTSIDE_DIRS if not os.path.lexists(d)]}
            # Which dirs existed before: /run/embedops is created just above by the lock, so check its parent's
            # own bookkeeping: it is ours if nothing but our lock and state dir is in it.
            if set(os.listdir(STATE.parent)) <= {LOCK.name, STATE.name}:
                rec["outside_dirs"].append(str(STATE.parent))
            for k in SYSCTLS:
                v = _sysctl_get(k)
                if v is not None:
                    rec["sysctls"][k] = v
            for cmd in ("iptables", "ip6tables"):
                rec["iptables"][cmd] = {t: sorted(c) for t, c in _chains_and_rules(_iptables_save(cmd))[0].items()}
                rec["iptables"][cmd + "_rules"] = _chains_and_rules(_iptables_save(cmd))[1]
            for h in _cgroup_hierarchies():
                if h.is_dir() and not (h / "kubepods").exists():
                    rec["cgroups"].append(str(h / "kubepods"))
            rec["links"] = [BRIDGE]
            rec["links_before"] = [ln.split(":")[1].strip().split("@")[0] for ln in
                                   _run("ip", "-o", "link", "show", check=False).stdout.splitlines()]
            rec["routes"] = [["blackhole", KWOK_POD_CIDR], [SERVICE_CIDR, "dev", BRIDGE]]
            self._save(rec)
            rec["api_port"] = api_port
            self._save(rec)
            try:
                self._network(api_port)
            except Exception:
                _teardown(rec)
                raise

    def _network(self, api_port: int | None) -> None:
        if _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            raise RuntimeError(f"interface {BRIDGE} exists and is not in the node record; remove it by hand")
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        _run("ip", "route", "replace", "blackhole", KWOK_POD_CIDR)
        _run("ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE, "src", HOST_IP)
        # Guards in mangle (evaluated before filter, where kube-proxy's ACCEPT rules live).
        _run("iptables", "-t", "mangle", "-N", GUARD_FWD)
        _run("iptables", "-t", "mangle", "-A", GUARD_FWD, "-i", BRIDGE, "-o", BRIDGE, "-j", "RETURN")
        _run("iptables", "-t", "mangle", "-A", GUARD_FWD, "-j", "DROP")
        _run("iptables", "-t", "mangle", "-I", "FORWARD", "1", "-j", GUARD_FWD)
        _run("iptables", "-t", "mangle", "-N", GUARD_OUT)
        _run("iptables", "-t", "mangle", "-A", GUARD_OUT, "-o", BRIDGE, "-j", "RETURN")
        _run("iptables", "-t", "mangle", "-A", GUARD_OUT, "-o", "lo", "-j", "RETURN")
        for cidr in (POD_CIDR, SERVICE_CIDR, KWOK_POD_CIDR):
            _run("iptables", "-t", "mangle", "-A", GUARD_OUT, "-m", "conntrack", "--ctorigdst", cidr, "-j", "DROP")
            _run("iptables", "-t", "mangle", "-A", GUARD_OUT, "-d", cidr, "-j", "DROP")
        _run("iptables", "-t", "mangle", "-I", "POSTROUTING", "1", "-j", GUARD_OUT)
        if api_port:
            for cmd in ("iptables", "ip6tables"):
                _run(cmd, "-t", "mangle", "-N", GUARD_IN)
                _run(cmd, "-t", "mangle", "-A", GUARD_IN, "-i", "lo", "-j", "RETURN")
                _run(cmd, "-t", "mangle", "-A", GUARD_IN, "-i", BRIDGE, "-j", "RETURN")
                _run(cmd, "-t", "mangle", "-A", GUARD_IN, "-p", "tcp", "--dport", str(api_port), "-j", "DROP")
                _run(cmd, "-t", "mangle", "-I", "INPUT", "1", "-j", GUARD_IN)
        # Service traffic between pods on the bridge goes through iptables (kube-proxy's DNAT); hairpin needs
        # forwarding on, which the guards above restrict to the bridge.
        _sysctl_set("net/bridge/bridge-nf-call-iptables", "1")
        _sysctl_set("net/ipv4/ip_forward", "1")

    # --- up ----------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> dict:
        log = open(self.logs / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=self.data, env=env)
        log.close()
        self._children[p.pid] = p
        for _ in range(50):
            start = _proc_start(p.pid)
            if start:
                break
            time.sleep(0.01)
        entry = {"name": name, "pid": p.pid, "argv0": argv[0], "start": _proc_start(p.pid)}
        with _locked():
            rec = self.record() or {}
            rec.setdefault("procs", []).append(entry)
            self._save(rec)
        return entry

    def _check_alive(self, what: str) -> None:
        rec = self.record() or {}
        dead = [p["name"] for p in rec.get("procs", []) if not process_alive(p)]
        if dead:
            # the log's last lines go into the message: a CI run's log directory is gone when the message is read
            deaths = [self._death(p) for p in rec.get("procs", []) if not process_alive(p)]
            tails = "".join(f"\n--- last lines of {n}.log ---\n{self._log_tail(n)}" for n in dead)
            raise NodeProcessExited(f"{', '.join(deaths)} exited while waiting for {what}; see {self.logs}{tails}")

    def _death(self, p: dict) -> str:
        """``name (exit status N)`` or ``name (signal S)``: a silent exit is told apart from a crash."""
        child = self._children.get(p["pid"])
        code = child.poll() if child is not None else None
        if code is None:
            return p["name"]
        return f"{p['name']} ({f'signal {-code}' if code < 0 else f'exit status {code}'})"

    def _log_tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(unreadable: {e})"

    def _forget_process(self, name: str) -> None:
        """Drop a dead process's entry from the record, so that a restarted one is the only one checked."""
        with _locked():
            rec = self.record() or {}
            rec["procs"] = [p for p in rec.get("procs", []) if p["name"] != name or process_alive(p)]
            self._save(rec)

    def _wait(self, what: str, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            self._check_alive(what)
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; see {self.logs}")

    def up(self, server: str, pki: Path, api, timeout: float = 120) -> None:
        """Start containerd, kubelet, kube-proxy and CoreDNS against the API server at ``server`` and wait
        until the node is Ready and CoreDNS serves. Call after ``prepare()`` and once the control plane is
        up; ``pki`` has ``ca.crt``/``ca.key``; ``api`` is an admin ``kubernetes.client.ApiClient``."""
        from kubernetes import client

        if api is not None:
            _apply_rbac(api)
        bins = NodeBinaries.from_cache()
        pause_name, pause_tar = pause_image()
        t0 = time.monotonic()
        d = self.data
        shutil.rmtree(self.logs, ignore_errors=True)
        for sub in ("logs", "kubelet", "containerd", "pod-logs", "pki"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("cni/net.d", "cni/ipam", "runc"):
            (STATE / sub).mkdir(parents=True, exist_ok=True)
        kcs = self._credentials(server, pki)
        self._start_containerd(pause_name, pause_tar)
        self._start_coredns(bins, kcs["coredns"])
        self._start_kube_proxy(bins, kcs["kube-proxy"])
        t_kubelet = time.monotonic()
        self._start_kubelet(bins, pki, kcs["kubelet-client"], pause_name)
        self._finish(client.CoreV1Api(api), t_kubelet, timeout)
        self._start_kube_router(bins, kcs["kube-router"], timeout)
        self.up_seconds = round(time.monotonic() - t0, 1)

    def _credentials(self, server: str, pki: Path) -> dict[str, Path]:
        """The node components' client certificates, the kubelet's serving one, and a kubeconfig per component."""
        from .pki import make_client_cert, make_serving_cert

        npki = self.data / "pki"
        for name, subj in (("kubelet-client", f"/O=system:nodes/CN=system:node:{NODE_NAME}"),
                           ("kube-proxy", "/CN=system:kube-proxy"),
                           ("coredns", "/CN=embedops:coredns"),
                           ("kube-router", "/CN=embedops:kube-router")):
            make_client_cert(pki, npki, name, subj)
        make_serving_cert(pki, npki, "kubelet-serving", f"/CN={NODE_NAME}", [f"IP:{HOST_IP}", f"DNS:{NODE_NAME}"])
        kcs = {}
        for name in ("kubelet-client", "kube-proxy", "coredns", "kube-router"):
            kcs[name] = self.data / f"{name}.kubeconfig"
            _write_kubeconfig(kcs[name], server, pki / "ca.crt", npki / f"{name}.crt", npki / f"{name}.key")
        return kcs

    def _start_containerd(self, pause_name: str, pause_tar) -> None:
        d = self.data
        (STATE / "cni" / "net.d" / "10-embedops.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "embedops",
            "plugins": [{
                "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(STATE / "cni" / "ipam"),
                         "ranges": [[{"subnet": POD_CIDR, "rangeStart": "10.245.0.10", "gateway": HOST_IP}]],
                         "routes": [{"dst": "0.0.0.0/0"}]},
            }],
        }, indent=1))
        conf = d / "containerd.toml"
        conf.write_text(CONTAINERD_TOML.format(root=d / "containerd", state=STATE / "containerd", sock=SOCK,
                                               opt=d / "containerd-opt", pause=pause_name,
                                               runc_root=STATE / "runc", cni_conf=STATE / "cni" / "net.d"))
        # Image pulls must not leave the machine either (not even a DNS lookup of the registry's name through
        # the host's resolver): every registry request goes to a proxy on loopback that does not exist, so a
        # pull fails at once ("proxyconnect ... connection refused"). Images come from import_images().
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy")}
        env.update({"HTTP_PROXY": NO_PROXY_URL, "HTTPS_PROXY": NO_PROXY_URL, "http_proxy": NO_PROXY_URL,
                    "https_proxy": NO_PROXY_URL})
        self._spawn("containerd", [shutil.which("containerd"), "--config", str(conf)], env=env)
        self._wait("containerd socket", lambda: _run("ctr", "--address", str(SOCK), "version",
                                                     check=False).returncode == 0, 30)
        import_into_containerd(str(SOCK), [pause_tar])

    def _start_coredns(self, bins: NodeBinaries, kubeconfig: Path) -> None:
        from .pki import free_port

        d = self.data
        ready_port, health_port = free_port(), free_port()
        corefile = d / "Corefile"
        corefile.write_text(COREFILE.format(ip=DNS_IP, domain=CLUSTER_DOMAIN, ready=ready_port,
                                            health=health_port, kubeconfig=kubeconfig))
        self._spawn("coredns", [str(bins.coredns), "-conf", str(corefile)])

    def _start_kube_proxy(self, bins: NodeBinaries, kubeconfig: Path) -> None:
        from .pki import free_port

        d = self.data
        kp = d / "kube-proxy.yaml"
        kp.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables", "clusterCIDR": POD_CIDR, "hostnameOverride": NODE_NAME,
            "bindAddress": HOST_IP,
            "healthzBindAddress": f"127.0.0.1:{free_port()}", "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "nodePortAddresses": [f"{HOST_IP}/32"], "oomScoreAdj": 0,
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
            # syncPeriod 5 s (default 30 s): kube-router's policy controller restores the whole filter table it
            # saved a moment before (cloudnativelabs/kube-router#1248, #1372), which can undo kube-proxy's newest
            # filter rules, e.g. put back a "has no endpoints" REJECT of a Service that just got its first ready
            # pod; kube-proxy writes them again at its next sync, so this bounds that window
            "iptables": {"localhostNodePorts": False, "syncPeriod": "5s", "minSyncPeriod": "0s"},
            "detectLocalMode": "ClusterCIDR",
        }, indent=1))
        self._spawn("kube-proxy", [str(bins.kube_proxy), f"--config={kp}", "--v=1"])

    def _start_kubelet(self, bins: NodeBinaries, pki: Path, kubeconfig: Path, pause_name: str) -> None:
        from .pki import free_port

        d = self.data
        npki = d / "pki"
        resolv = d / "resolv.conf"
        resolv.write_text("# no host resolvers: pods only ever see the cluster DNS\n")
        static = d / "static-pods"
        shutil.rmtree(static, ignore_errors=True)
        static.mkdir()
        (static / f"{IMAGE_KEEPER}.json").write_text(json.dumps(image_keeper_pod(pause_name), indent=1))
        self.kubelet_port = free_port()
        kc = d / "kubelet.yaml"
        kc.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": HOST_IP, "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            "tlsCertFile": str(npki / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(npki / "kubelet-serving.key"),
            "authentication": {"x509": {"clientCAFile": str(pki / "ca.crt")}, "webhook": {"enabled": False},
                               "anonymous": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs", "containerRuntimeEndpoint": f"unix://{SOCK}",
            "imageServiceEndpoint": f"unix://{SOCK}",
            "clusterDNS": [DNS_IP], "clusterDomain": CLUSTER_DOMAIN, "resolvConf": str(resolv),
            "failSwapOn": False, "makeIPTablesUtilChains": False,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1Gi", "imagefs.available": "1Gi",
                             "nodefs.inodesFree": "1%", "imagefs.inodesFree": "1%"},
            "evictionPressureTransitionPeriod": "10s",
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "podLogsDir": str(d / "pod-logs"), "serializeImagePulls": False, "staticPodPath": str(static),
            "registerNode": True, "maxPods": 110, "podCIDR": POD_CIDR,
            "nodeStatusUpdateFrequency": "5s", "nodeStatusReportFrequency": "30s",
            "syncFrequency": "10s", "fileCheckFrequency": "20s", "runtimeRequestTimeout": "2m",
            "containerLogMaxSize": "10Mi", "containerLogMaxFiles": 2,
            "protectKernelDefaults": False, "kernelMemcgNotification": False,
            "shutdownGracePeriod": "0s", "localStorageCapacityIsolation": True,
        }, indent=1))
        self._spawn("kubelet", [
            str(bins.kubelet), f"--config={kc}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={d / 'kubelet'}", f"--node-ip={HOST_IP}", f"--hostname-override={NODE_NAME}",
            f"--node-labels={REAL_NODE_LABEL}=true", f"--cert-dir={npki}", "--v=1",
            *([f"--register-with-taints={REAL_NODE_TAINT['key']}={REAL_NODE_TAINT['value']}:"
               f"{REAL_NODE_TAINT['effect']}"] if os.environ.get("EMBEDOPS_REAL_NODE_TAINT", "1") != "0" else []),
        ])

    def _start_kube_router(self, bins: NodeBinaries, kubeconfig: Path, timeout: float) -> None:
        # kube-router: NetworkPolicy only, started once its Node exists (it exits when it cannot find it). It
        # admits the node's own traffic to its pods (kubelet probes) and rejects (not drops) what a policy refuses,
        # so a refused client hears so at once. Its iptables chains (KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-*)
        # and ipsets are removed by down() from the record, not by `--cleanup-config`, which panics in v2.1.0
        # (its service proxy's hairpin cleanup) and leaves them.
        argv = [
            str(bins.kube_router), f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
            # no sockets: its health port would listen on every interface (it has no address flag); its first
            # sync's chain tells that it runs
            "--health-port=0", "--metrics-port=0", "--v=1"]
        # Started again (three starts in all) when it exits before its first sync: it exits rather than retries on a
        # failed start-up step. Seen once in CI (log gone) and once here, the first real node after the machine
        # started, a silent exit not seen again; a third exit is an error that carries the log's last lines.
        for attempt in (1, 2, 3):
            self._spawn("kube-router", argv)
            try:
                self._wait("kube-router's first sync", lambda: _run(
                    "iptables", "-t", "filter", "-S", "KUBE-ROUTER-FORWARD", check=False).returncode == 0, timeout)
                return
            except NodeProcessExited as e:
                if attempt == 3 or any(not process_alive(p) for p in (self.record() or {}).get("procs", [])
                                       if p["name"] != "kube-router"):
                    raise
                print(f"kube-router: started again after: {e}", file=sys.stderr)
                self._forget_process("kube-router")
                time.sleep(1)

    def _finish(self, core, t_kubelet: float, timeout: float) -> None:
        """Label the node (NFD names) and wait until it is Ready, untainted, and CoreDNS is ready."""
        from kubernetes.client.rest import ApiException

        def registered() -> bool:
            try:
                core.read_node(NODE_NAME)
                return True
            except ApiException:
                return False

        self._wait(f"node {NODE_NAME} registered", registered, timeout)
        core.patch_node(NODE_NAME, {"metadata": {"labels": node_labels()}})

        def ready() -> bool:
            n = core.read_node(NODE_NAME)
            ok = any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
            return ok and not any(t.key.startswith("node.kubernetes.io/") for t in (n.spec.taints or []))

        self._wait(f"node {NODE_NAME} Ready", ready, timeout)
        self.ready_seconds = round(time.monotonic() - t_kubelet, 1)

        ready_port = re.search(r"ready 127\.0\.0\.1:(\d+)", (self.data / "Corefile").read_text()).group(1)

        def dns_ready() -> bool:
            import urllib.request
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        self._wait("CoreDNS ready", dns_ready, timeout)

    def import_images(self, archives) -> None:
        import_into_containerd(str(SOCK), [Path(a) for a in archives])

    # --- down ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the node's processes and pods only (the cluster stops its control plane next, while the bridge
        address still exists, then calls down())."""
        with _locked():
            rec = self.record()
            if rec and rec.get("owner") == str(self.run_dir):
                _stop_processes(rec)

    def down(self) -> list[str]:
        """Remove what the record holds (only if this run dir owns it). Returns what could not be removed."""
        with _locked():
            rec = self.record()
            if not rec or rec.get("owner") != str(self.run_dir):
                return []
            return _teardown(rec)


def _alive_cp(p: dict) -> bool:
    """A harness control-plane process entry (pid, argv0; no start time) is alive."""
    try:
        cmdline = Path(f"/proc/{p['pid']}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return cmdline == p.get("argv0") and _proc_start(p["pid"]) is not None


def _stop(procs: list[dict], timeout: float = 15) -> None:
    for p in procs:
        if process_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        while process_alive(p) and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p["pid"], signal.SIGKILL)
            while process_alive(p):
                time.sleep(0.05)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p["pid"], os.WNOHANG)


def _cgroup_procs(dirs: list[str]) -> set[int]:
    pids: set[int] = set()
    for top in dirs:
        for root, _, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    pids |= {int(x) for x in Path(root, "cgroup.procs").read_text().split()}
    return pids


def _shims(state: str) -> list[dict]:
    """containerd-shim-runc-v2 processes serving our containerd (its socket address in their argv)."""
    out = []
    sock = str(Path(state) / "containerd.sock")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if args and args[0].endswith("containerd-shim-runc-v2") and sock in args:
            out.append({"pid": int(pid), "argv0": args[0], "start": _proc_start(int(pid))})
    return out


def _stop_processes(rec: dict) -> None:
    """kubelet first (it would restart containers), every process in the kubepods cgroups, then the other node
    processes and the shims of this containerd."""
    procs = rec.get("procs", [])
    _stop([p for p in procs if p["name"] == "kubelet"])
    cg = [c for c in rec.get("cgroups", []) if os.path.isdir(c)]
    for _ in range(50):
        pids = _cgroup_procs(cg)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _stop([p for p in reversed(procs) if p["name"] != "kubelet"])
    _stop(_shims(rec.get("state", str(STATE))))


def _teardown(rec: dict) -> list[str]:
    """Remove everything the record lists, in the order each step needs (processes before their mounts, mounts
    before their cgroups and dirs, rules before their chains and sets); tolerant of half-made state. Returns
    leftovers (empty = clean)."""
    _stop_processes(rec)
    # mounts under the node's dirs (netns, shm, rootfs overlays, the kubelet root's shared bind mount)
    problems = [f"mount {m}" for m in _umount_all([Path(rec["data"]), Path(rec.get("state", str(STATE)))])]
    for step in (_remove_cgroups, _remove_iptables_rules, _remove_ipsets, _remove_nft_tables):
        problems += step(rec)
    _remove_links_and_routes(rec)
    problems += _restore_sysctls(rec)
    problems += _remove_dirs(rec)
    state = Path(rec.get("state", str(STATE)))
    if not problems:
        RECORD.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            state.rmdir()
        if str(STATE.parent) in rec.get("outside_dirs", []):
            with contextlib.suppress(OSError):
                LOCK.unlink()
                STATE.parent.rmdir()
    return problems


def _remove_cgroups(rec: dict) -> list[str]:
    """The node's cgroups, deepest first (a dying process can keep one busy for a moment)."""
    problems: list[str] = []
    for c in rec.get("cgroups", []):
        if not os.path.isdir(c):
            continue
        dirs = sorted((r for r, _, _ in os.walk(c)), key=lambda x: -x.count("/"))
        for dd in dirs:
            for _ in range(50):
                try:
                    os.rmdir(dd)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        if os.path.isdir(c):
            problems.append(f"cgroup {c}")
    return problems


def _remove_iptables_rules(rec: dict) -> list[str]:
    """Rules jumping to KUBE-*/EMBEDOPS-* chains that were not there before, then those chains."""
    problems: list[str] = []
    for cmd in ("iptables", "ip6tables"):
        before_chains = rec.get("iptables", {}).get(cmd, {})
        before_rules = rec.get("iptables", {}).get(cmd + "_rules", {})
        chains, rules = _chains_and_rules(_iptables_save(cmd))
        for table, rl in rules.items():
            new_chains = [c for c in chains[table] if _ours(c) and c not in before_chains.get(table, [])]
            for r in rl:
                parts = r.split()
                chain = parts[1]
                target = parts[parts.index("-j") + 1] if "-j" in parts else None
                if chain in new_chains or r in before_rules.get(table, []):
                    continue
                if target and _ours(target):
                    import shlex
                    p = _run(cmd, "-t", table, "-D", *shlex.split(r)[1:], check=False)
                    if p.returncode != 0:
                        problems.append(f"{cmd} -t {table} {r}: {p.stderr.strip()}")
            for c in new_chains:
                _run(cmd, "-t", table, "-F", c, check=False)
            for c in new_chains:
                p = _run(cmd, "-t", table, "-X", c, check=False)
                if p.returncode != 0:
                    problems.append(f"{cmd} -t {table} chain {c}: {p.stderr.strip()}")
    return problems


def _remove_ipsets(rec: dict) -> list[str]:
    """kube-router's ipsets (referenced by the rules just removed), those that were not there before."""
    problems: list[str] = []
    before_sets = set(rec.get("ipsets_before", []))
    for name in _ipsets():
        if name not in before_sets and _kube_router_set(name):
            p = _run("ipset", "destroy", name, check=False)
            if p.returncode != 0:
                problems.append(f"ipset {name}: {p.stderr.strip()}")
    return problems


def _remove_nft_tables(rec: dict) -> list[str]:
    """nftables tables that appeared while the node ran: kube-proxy's own, or empty ones iptables-nft made."""
    problems: list[str] = []
    before_nft = set(rec.get("nft_tables_before", []))
    for t in _nft_tables():
        if t in before_nft:
            continue
        fam, name = t.split()
        listed = _run("nft", "list", "table", fam, name, check=False).stdout
        body = [ln.strip() for ln in listed.splitlines()]
        rules = [ln for ln in body if ln and not ln.startswith(("table ", "chain ", "type ", "policy ", "}", "#"))]
        if name.startswith("kube-proxy") or not rules:
            p = _run("nft", "delete", "table", fam, name, check=False)
            if p.returncode != 0:
                problems.append(f"nft table {t}: {p.stderr.strip()}")
    return problems


def _remove_links_and_routes(rec: dict) -> None:
    """The bridge (and veths still enslaved to it) and the routes the node added."""
    for link in rec.get("links", []):
        if _run("ip", "link", "show", link, check=False).returncode == 0:
            # veths still enslaved (their netns should be gone by now)
            out = _run("ip", "-o", "link", "show", "master", link, check=False).stdout
            for line in out.splitlines():
                veth = line.split(":")[1].strip().split("@")[0]
                _run("ip", "link", "delete", veth, check=False)
            _run("ip", "link", "delete", link, check=False)
    for r in rec.get("routes", []):
        _run("ip", "route", "del", *r, check=False)


def _restore_sysctls(rec: dict) -> list[str]:
    """Sysctls back to their recorded values."""
    problems: list[str] = []
    for k, v in rec.get("sysctls", {}).items():
        if _sysctl_get(k) != v:
            try:
                _sysctl_set(k, v)
            except OSError as e:
                problems.append(f"sysctl {k}: {e}")
    # ip_forward resets every interface's forwarding; put the recorded per-key values back after it
    for k, v in rec.get("sysctls", {}).items():
        if k != "net/ipv4/ip_forward" and _sysctl_get(k) != v:
            with contextlib.suppress(OSError):
                _sysctl_set(k, v)
    return problems


def _remove_dirs(rec: dict) -> list[str]:
    """The node's runtime data and state, and the dirs it created outside them (its run dir keeps logs,
    configs and certificates)."""
    problems: list[str] = []
    for sub in DATA_SUBDIRS:
        dd = Path(rec["data"], sub)
        if dd.exists() and not _mountpoints_under([dd]):
            shutil.rmtree(dd, ignore_errors=True)
        if dd.exists():
            problems.append(f"dir {dd}")
    for dd in sorted(rec.get("outside_dirs", []), key=lambda x: -x.count("/")):
        if dd == str(STATE.parent):
            continue
        if os.path.lexists(dd) and not _mountpoints_under([Path(dd)]):
            shutil.rmtree(dd, ignore_errors=True)
    state = Path(rec.get("state", str(STATE)))
    if not _mountpoints_under([state]):
        for child in state.iterdir() if state.exists() else []:
            if child.name != RECORD.name:
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
    return problems


def leftovers(rec: dict) -> list[str]:
    """What of a torn-down node is still on the machine, checked against the record's before-state."""
    out = []
    for p in rec.get("procs", []):
        if process_alive(p):
            out.append(f"process {p['name']} ({p['pid']})")
    state, data = rec.get("state", str(STATE)), rec["data"]
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if state in cmd or data in cmd:
                out.append(f"process {pid}: {cmd.replace(chr(0), ' ')[:120]}")
    out += [f"mount {m}" for m in _mountpoints_under([Path(data), Path(state)])]
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name in rec.get("links", []) or (name.startswith("veth") and name not in rec.get("links_before", [])):
            out.append(f"interface {name}")
    routes = _run("ip", "route", "show", "table", "all", check=False).stdout
    for cidr in (POD_CIDR, SERVICE_CIDR, KWOK_POD_CIDR):
        if any(ln.split()[0] == cidr or ln.split()[:2] == ["blackhole", cidr] for ln in routes.splitlines()):
            out.append(f"route {cidr}")
    for cmd in ("iptables", "ip6tables"):
        before = rec.get("iptables", {}).get(cmd, {})
        chains, rules = _chains_and_rules(_iptables_save(cmd))
        for table, cs in chains.items():
            out += [f"{cmd} -t {table} chain {c}" for c in cs if _ours(c) and c not in before.get(table, [])]
            out += [f"{cmd} -t {table} {r}" for r in rules[table]
                    if (" -j KUBE-" in r or " -j EMBEDOPS-" in r)
                    and r not in rec.get("iptables", {}).get(cmd + "_rules", {}).get(table, [])]
    out += [f"nft table {t}" for t in _nft_tables() if t not in rec.get("nft_tables_before", [])]
    out += [f"ipset {n}" for n in _ipsets() if _kube_router_set(n) and n not in rec.get("ipsets_before", [])]
    out += [f"cgroup {c}" for c in rec.get("cgroups", []) if os.path.exists(c)]
    for k, v in rec.get("sysctls", {}).items():
        if _sysctl_get(k) != v:
            out.append(f"sysctl {k}={_sysctl_get(k)} (was {v})")
    out += [f"dir {d}" for d in rec.get("outside_dirs", []) if os.path.lexists(d)]
    out += [f"dir {data}/{sub}" for sub in DATA_SUBDIRS if os.path.lexists(Path(data, sub))]
    if RECORD.exists():
        out.append(f"record {RECORD}")
    return out


def _write_kubeconfig(path: Path, server: str, ca: Path, crt: Path, key: Path) -> None:
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "embedops",
        "clusters": [{"name": "embedops", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": {"client-certificate": str(crt), "client-key": str(key)}}],
        "contexts": [{"name": "embedops", "context": {"cluster": "embedops", "user": "u"}}],
    }
    path.write_text(json.dumps(cfg, indent=1))
    os.chmod(path, 0o600)


def _apply_rbac(api) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    rbac = client.RbacAuthorizationV1Api(api)
    for doc, create in ((COREDNS_RBAC[0], rbac.create_cluster_role),
                        (COREDNS_RBAC[1], rbac.create_cluster_role_binding),
                        (KUBE_ROUTER_RBAC[0], rbac.create_cluster_role),
                        (KUBE_ROUTER_RBAC[1], rbac.create_cluster_role_binding)):
        try:
            create(doc)
        except ApiException as e:
            if e.status != 409:
                raise


COREDNS_RBAC = [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
     "metadata": {"name": "embedops:coredns"},
     "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                "verbs": ["list", "watch"]},
               {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "embedops:coredns"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "embedops:coredns"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "embedops:coredns"}]},
]

# What kube-router's controllers read (its own firewall DaemonSet's ClusterRole, without the write verbs that
# routing and the service proxy need)
KUBE_ROUTER_RBAC = [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
     "metadata": {"name": "embedops:kube-router"},
     "rules": [{"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
                "verbs": ["get", "list", "watch"]},
               {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch"]},
               {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "embedops:kube-router"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "embedops:kube-router"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "embedops:kube-router"}]},
]

CONTAINERD_TOML = """\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{sock}"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runc_root}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""

COREFILE = """\
{domain}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {ip}
    errors
    ready 127.0.0.1:{ready}
    health 127.0.0.1:{health}
    kubernetes {domain} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} embedops
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""


def status() -> str:
    """Who holds the machine's real node: 'free' or 'held by <run dir> (alive|stale)'."""
    rec = RealNode.record()
    if not rec:
        return "free"
    return f"held by {rec['owner']} ({'alive' if RealNode._owner_alive(rec) else 'stale'})"


def remove_leftovers() -> list[str]:
    """Remove what the node's record lists (processes, mounts, network, cgroups), whoever owned it; returns
    what could not be removed. For a record no live cluster owns any more."""
    left = RealNode.record()
    if not left:
        return []
    with _locked():
        return _teardown(left)


def main(argv: list[str] | None = None) -> int:
    """``python -m localcluster.node status``: who holds the machine's real node. Releasing it (its owner's
    whole cluster) is ``python -m localcluster.controlplane release-node``."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if (argv[0] if argv else "status") == "status":
        print(status())
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
