"""A kind node image built on this machine (issue 40), for ``make e2e-kind`` with podman as kind's provider.

Users' CI runs the e2e suite on kind with ``kindest/node`` from a registry; no registry can be reached here, so
the node image is made the way kind's own ``images/base`` and ``build node-image`` make it, from what this
machine can build:

* the root file system: ``debootstrap --variant=minbase bookworm`` with the packages kind's base image
  installs (systemd, iptables, iproute2, ...) plus Debian's containerd, runc and CNI plugins (kind builds its
  own; Debian's are older, containerd 1.6), imported as ``localhost/embedops-kind-rootfs:<hash>``;
* kind's ``images/base/files`` from the kind Go module (entrypoint, containerd config, the kubelet unit and
  its kubeadm drop-ins, sysctls), laid in as kind's Dockerfile does, with its systemd clean-up;
* the kubelet from the local cluster's multi-call binary (component ``k8s``) and kubeadm and kubectl from
  ``kind-tools`` (the same Kubernetes release);
* the images kubeadm starts, preloaded into the node's containerd under the names kubeadm gives them
  (``kubeadm config images list``): one image of the local cluster's binaries (the k8s multi-call binary,
  etcd, CoreDNS with the plugins of kubeadm's Corefile, kube-router) on a small Debian base with iptables and
  ipset, tagged as kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd and coredns (its
  entry point is CoreDNS, the one of them started without a command); the pause image of the real node,
  tagged as kubeadm's and containerd's sandbox image;
* ``/kind/manifests/default-cni.yaml``: kube-router as the pod network (``localcluster/kind/default-cni.yaml``:
  kind's own kindnetd is not served by this machine's module proxy). No ``default-storage.yaml``: kind then
  installs its legacy host-path StorageClass.

CLI: ``python -m localcluster.kindnode build`` prints the node image's name (built once per content hash).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import node
from .build import Builder
from .components import BY_NAME, KUBERNETES_VERSION
from .images import (
    build_lock,
    cache_root,
    debootstrap_image,
    local_image_id,
    podman_usable,
    run_command,
)

HERE = Path(__file__).resolve().parent
KIND_VERSION = "v0.30.0"  # v0.31 drops cgroup v1 hosts (with Kubernetes 1.35); this machine is cgroup v1
NODE_PACKAGES = ("systemd", "systemd-sysv", "conntrack", "iptables", "nftables", "iproute2", "ethtool",
                 "util-linux", "mount", "kmod", "libseccomp2", "pigz", "bash", "ca-certificates", "curl", "jq",
                 "procps", "containerd", "runc", "containernetworking-plugins")
# What kube-proxy (iptables mode) and kube-router (bridge, routes, iptables, ipset) run inside their pods
SYSTEM_PACKAGES = ("iptables", "ipset", "conntrack", "iproute2", "kmod", "ca-certificates")
SYSTEM_TOOLS = {  # binary in the image -> (component, file)
    "k8s": ("k8s", "k8s"), "etcd": ("etcd", "etcd"), "coredns": ("coredns-kind", "coredns"),
    "kube-router": ("kube-router", "kube-router"),
}
SYSTEM_TOOLS_COMPONENTS = tuple(dict.fromkeys(c for c, _ in SYSTEM_TOOLS.values()))
K8S_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet")
NODE_REPO = "localhost/embedops-kind-node"


def say(msg: str) -> None:
    print(f"[kindnode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _hash(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:12]


def _file_digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def debian_image(name: str, packages: tuple[str, ...]) -> str:
    """``localhost/embedops-<name>:<hash of the package list>``: a debootstrap minbase root with ``packages``."""
    ref = f"localhost/embedops-{name}:{_hash(*packages)}"
    with build_lock(ref):
        if not local_image_id(ref):
            debootstrap_image(ref, packages)
    return ref


def kind_module_dir() -> Path:
    """kind's Go module (its images/base/files), from the module cache or the proxy."""
    out = run_command(["go", "mod", "download", "-json", f"sigs.k8s.io/kind@{KIND_VERSION}"], capture_output=True,
                      cwd=tempfile.gettempdir(), env={**os.environ, "GOFLAGS": ""}).stdout
    return Path(json.loads(out)["Dir"])


def kubeadm_image_names(kubeadm: Path) -> list[str]:
    """The images ``kubeadm init`` of this release starts, as it names them."""
    out = run_command([str(kubeadm), "config", "images", "list", "--kubernetes-version", KUBERNETES_VERSION],
                      capture_output=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def _podman_build(ref: str, ctx: Path, containerfile: str, base: str) -> None:
    (ctx / "Containerfile").write_text(containerfile)
    run_command(["podman", "build", "--network=none", "--pull=never", "--layers=false", "--rm", "--quiet",
                 "--build-arg", f"BASE_IMAGE={base}", "-f", str(ctx / "Containerfile"), "-t", ref, str(ctx)],
                capture_output=True)


SYSTEM_CONTAINERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY bin/ /usr/local/bin/
RUN cd /usr/local/bin && for c in %s; do ln -s k8s "$c"; done && ln -s /usr/local/bin/coredns /coredns
ENTRYPOINT ["/coredns"]
"""


def system_images(names: list[str]) -> list[str]:
    """The control plane's, kube-proxy's, CoreDNS's and kube-router's images: one image, tagged with every name
    kubeadm gives them, and the pause image under its names; returns the tags (the kube-router one last). Each
    tag names content: the system image's tag hashes its base and binaries."""
    base = debian_image("kind-system-base", SYSTEM_PACKAGES)
    files = {b: BY_NAME[c].path(f) for b, (c, f) in SYSTEM_TOOLS.items()}
    digests = (b + _file_digest(p).hex() for b, p in files.items())
    ref = f"localhost/embedops-kind-system:{_hash(local_image_id(base) or base, SYSTEM_CONTAINERFILE, *digests)}"
    with build_lock(ref):
        if not local_image_id(ref):
            with tempfile.TemporaryDirectory(dir=cache_root()) as d:
                ctx = Path(d)
                (ctx / "bin").mkdir()
                for b, p in files.items():
                    shutil.copy2(p, ctx / "bin" / b)
                _podman_build(ref, ctx, SYSTEM_CONTAINERFILE % " ".join(K8S_COMMANDS), base)
            say(f"built {ref}")
    pause_ref, pause_archive = node.pause_image()
    if not local_image_id(pause_ref):
        run_command(["podman", "load", "--quiet", "-i", str(pause_archive)], capture_output=True)
    sandbox = "registry.k8s.io/pause:3.10"  # kind's containerd config pins this sandbox image
    tagged = {n: pause_ref if "/pause:" in n else ref for n in names}
    tagged.setdefault(sandbox, pause_ref)
    tagged[f"localhost/embedops-kind-kube-router:{ref.rsplit(':', 1)[1]}"] = ref
    for name, source in tagged.items():
        run_command(["podman", "tag", source, name])
    return list(tagged)


# kind's Dockerfile steps, with Debian's containerd, runc and CNI plugins in the places kind's own builds take.
# restrict_oom_score_adj: containerd clamps each container's OOM score to its own instead of lowering it (kind
# sets it for rootless nodes); this machine's root lacks CAP_SYS_RESOURCE, so a pod sandbox's -998 made runc
# fail ("failed to update /proc/self/oom_score_adj: Permission denied", shown as "can't get final child's PID").
NODE_CONTAINERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY files/ /
RUN chmod 755 /kind/bin /kind/bin/* /usr/local/bin/* \\
 && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \\
 && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \\
          /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \\
          /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \\
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \\
 && rm -f /lib/systemd/system/containerd.service \\
 && ln -sf /usr/bin/containerd /usr/local/bin/containerd && ln -sf /usr/bin/ctr /usr/local/bin/ctr \\
 && ln -sf /usr/bin/containerd-shim-runc-v2 /usr/local/bin/containerd-shim-runc-v2 \\
 && mkdir -p /opt/cni && ln -sfn /usr/lib/cni /opt/cni/bin \\
 && sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml \\
 && ctr oci spec | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \\
    | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \\
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \\
 && systemctl mask systemd-binfmt.service \\
 && mkdir -p /etc/kubernetes/manifests
"""

# Run once in the built image, privileged: containerd started by hand, every image imported into its k8s.io
# namespace as kind's node-image builder does (pinned, not unpacked), then stopped; the result is committed.
PRELOAD = """set -e
containerd >/tmp/containerd.log 2>&1 &
for i in $(seq 1 50); do [ -S /run/containerd/containerd.sock ] && ctr version >/dev/null 2>&1 && break; sleep 0.2; done
ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned --all-platforms --no-unpack --digests /kind/images/system.tar
ctr --namespace=k8s.io images list -q
kill %1; wait || true
rm -rf /kind/images /tmp/containerd.log
"""


def build_node_image() -> str:
    """The node image's name, built when podman does not have it (several minutes the first time)."""
    why = podman_usable()
    if why:
        raise RuntimeError(why)
    Builder().build_all([BY_NAME[n] for n in (*SYSTEM_TOOLS_COMPONENTS, "kind-tools")])
    kind_tools = BY_NAME["kind-tools"]
    kubelet = BY_NAME["k8s"].path("k8s")
    names = kubeadm_image_names(kind_tools.path("kubeadm"))
    files_dir = kind_module_dir() / "images" / "base" / "files"
    cni = (HERE / "kind" / "default-cni.yaml").read_text()
    rootfs = debian_image("kind-rootfs", NODE_PACKAGES)
    tags = system_images(names)
    cni = cni.replace("KUBE_ROUTER_IMAGE", tags[-1])
    key = _hash(local_image_id(rootfs) or rootfs, NODE_CONTAINERFILE, PRELOAD, cni, KIND_VERSION, *tags,
                _file_digest(kubelet), _file_digest(kind_tools.path("kind-tools")))
    ref = f"{NODE_REPO}:{KUBERNETES_VERSION}-{key}"
    with build_lock(ref), tempfile.TemporaryDirectory(dir=cache_root()) as d:
        if local_image_id(ref):
            return ref
        t0 = time.time()
        ctx = Path(d) / "ctx"
        files = ctx / "files"
        shutil.copytree(files_dir, files, ignore=shutil.ignore_patterns("containerd-fuse-overlayfs.service"))
        for p in files.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (files / "usr/bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(kubelet, files / "usr/bin/kubelet")
        shutil.copy2(kind_tools.path("kind-tools"), files / "usr/bin/kind-tools")
        for tool in ("kubeadm", "kubectl"):
            (files / "usr/bin" / tool).symlink_to("kind-tools")
        (files / "usr/bin/kubelet").chmod(0o755)
        (files / "usr/bin/kind-tools").chmod(0o755)
        (files / "kind/version").write_text(KUBERNETES_VERSION + "\n")
        (files / "kind/manifests").mkdir(parents=True, exist_ok=True)
        (files / "kind/manifests/default-cni.yaml").write_text(cni)
        (files / "kind/images").mkdir(parents=True, exist_ok=True)
        # one docker-archive holding every tag (content shared between tags is stored once)
        run_command(["podman", "save", "--quiet", "--multi-image-archive", "--format", "docker-archive",
                     "-o", str(files / "kind/images/system.tar"), *tags], capture_output=True)
        staged = f"{NODE_REPO}-staged:{key}"
        _podman_build(staged, ctx, NODE_CONTAINERFILE, rootfs)
        shutil.rmtree(ctx)
        container = f"embedops-kind-preload-{key}"
        subprocess.run(["podman", "rm", "-f", container], check=False, capture_output=True)
        try:
            r = subprocess.run(["podman", "run", "--name", container, "--privileged", "--network=none",
                                "--entrypoint", "/bin/bash", staged, "-c", PRELOAD],
                               check=False, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"preloading the node's images failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            say("preloaded: " + " ".join(r.stdout.split()))
            run_command(["podman", "commit", "--quiet",
                         "--change", 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]',
                         "--change", "CMD []", "--change", "STOPSIGNAL SIGRTMIN+3",
                         "--change", "ENV container=docker", container, ref], capture_output=True)
        finally:
            subprocess.run(["podman", "rm", "-f", container], check=False, capture_output=True)
            subprocess.run(["podman", "rmi", staged], check=False, capture_output=True)
        say(f"built {ref} in {time.time() - t0:.0f}s")
    return ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m localcluster.kindnode", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["build"])
    p.parse_args(argv)
    print(build_node_image())
    return 0


if __name__ == "__main__":
    sys.exit(main())
