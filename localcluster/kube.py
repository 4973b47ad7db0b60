"""A client of the local cluster (or any cluster given by a kubeconfig) for the demo and the tests: server-side
apply of YAML, the third-party CRDs the operator writes objects of, namespaces, and images imported into the
real node's containerd.

API (the demo and tests/integration, tests/e2e use it)::

    kube.kubeconfig                 # path (str)
    kube.api_client()               # a new kubernetes.client.ApiClient
    kube.install_crds(["servicemonitor", "httproute", "scaledobject"])   # upstream CRDs, Established
    kube.uninstall_crds([...])      # deleted and gone
    kube.apply(docs_or_path, namespace=None)   # server-side apply of YAML docs / a file
    kube.local                      # True when it is the harness's control plane (kwok nodes)
    kube.helm                       # path of the pinned helm binary, or None
    kube.real_node                  # "cpu-real-0" when the local cluster has its real node, else None
    kube.real_node_reason           # why there is no real node (one line), else None
    kube.import_images(images)      # into the real node's containerd: archive paths (docker/OCI tar) or
                                    # localcluster/images.py's built images (a list or its dict)
"""
from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import time
from pathlib import Path


def load_yaml(text: str) -> list[dict]:
    """The documents of a YAML stream, the way the API server reads them. PyYAML's safe loader follows YAML 1.1
    and takes a bare ``=`` for its "value" tag, which it cannot construct; Prometheus Operator's CRDs list
    ``=`` among relabel actions' enum values, where it is a string."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))
    return [d for d in yaml.load_all(text, Loader=Loader) if d]


class Kube:
    def __init__(self, kubeconfig: str, local: bool, helm: str | None = None, real_node: str | None = None,
                 real_node_reason: str | None = None):
        self.kubeconfig = kubeconfig
        self.local = local
        self.helm = helm
        self.real_node = real_node
        self.real_node_reason = real_node_reason

    def import_images(self, images) -> None:
        """Import image archives (paths of docker-archive/OCI tars, or what localcluster/images.py's
        ``import_into_containerd`` takes) into the real node's containerd (namespace k8s.io). On another
        cluster, how images reach its nodes is the cluster's own: ``$EMBEDOPS_E2E_IMAGE_LOADER``, a command given
        each archive (tests/e2e/kind.sh sets ``kind load image-archive --name <cluster>``)."""
        items = list(images.values()) if isinstance(images, dict) else list(images)
        paths = [i for i in items if isinstance(i, (str, Path))]
        built = [i for i in items if not isinstance(i, (str, Path))]
        if not self.real_node:
            loader = os.environ.get("EMBEDOPS_E2E_IMAGE_LOADER")
            if not loader:
                raise RuntimeError(f"no real node ({self.real_node_reason}) and no EMBEDOPS_E2E_IMAGE_LOADER")
            for archive in [*paths, *(i.archive for i in built)]:
                subprocess.run([*shlex.split(loader), str(archive)], check=True, stdout=subprocess.DEVNULL)
            return
        from localcluster import node

        if paths:
            node.import_into_containerd(str(node.SOCK), paths)
        if built:  # localcluster/images.py's built images (.ref, .archive)
            from localcluster.images import import_into_containerd

            import_into_containerd(str(node.SOCK), built)

    @contextlib.contextmanager
    def namespace(self, prefix: str = "t", labels: dict | None = None, name: str | None = None):
        """A new namespace (``name``, or ``<prefix>-<random>``), yielded once its default ServiceAccount exists
        (pods need it), deleted afterwards."""
        import uuid

        from kubernetes import client
        from kubernetes.client.rest import ApiException

        name = name or f"{prefix}-{uuid.uuid4().hex[:8]}"
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})

            deadline = time.monotonic() + 60
            while True:
                try:
                    core.read_namespaced_service_account("default", name)
                    break
                except ApiException:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no default ServiceAccount in {name} after 60 s") from None
                    time.sleep(0.25)
            try:
                yield name
            finally:
                core.delete_namespace(name)

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    # --- third-party CRDs ----------------------------------------------------------------------
    @staticmethod
    def _crd_docs(names) -> list[dict]:
        from localcluster.components import crd_files

        files = crd_files()
        docs = []
        for name in names:
            if name not in files:
                raise KeyError(f"unknown CRD {name!r}; known: {sorted(files)}")
            for f in files[name]:
                if not f.exists():
                    raise FileNotFoundError(f"{f} missing; run `make cluster-binaries`")
                docs += load_yaml(f.read_text())
        return docs

    def install_crds(self, names, timeout: float = 60) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        docs = self._crd_docs(names)
        with self.api_client() as api:
            ext = client.ApiextensionsV1Api(api)
            for d in docs:
                try:
                    ext.create_custom_resource_definition(d)
                except ApiException as e:
                    if e.status != 409:
                        raise
            deadline = time.monotonic() + timeout
            for d in docs:
                name = d["metadata"]["name"]
                while True:
                    crd = ext.read_custom_resource_definition(name)
                    conds = {c.type: c.status for c in (crd.status.conditions or [])}
                    if conds.get("Established") == "True" and crd.metadata.deletion_timestamp is None:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"CRD {name} not Established: {conds}")
                    time.sleep(0.2)
                # Established is not "served": until the watch cache of the new resource is initialized,
                # requests answer "storage is (re)initializing". A CRD deleted in that window makes the API
                # server's CRD finalizer fail and retry only a minute later (seen: 64 s uninstalls).
                spec = d["spec"]
                version = next(v["name"] for v in spec["versions"] if v.get("served", True))
                while True:
                    try:
                        client.CustomObjectsApi(api).list_cluster_custom_object(
                            spec["group"], version, spec["names"]["plural"], limit=1)
                        break
                    except ApiException as e:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"CRD {name} established but not served: {e.status} {e.reason}")
                        time.sleep(0.2)

    def uninstall_crds(self, names, timeout: float = 60) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        docs = self._crd_docs(names)
        with self.api_client() as api:
            ext = client.ApiextensionsV1Api(api)
            for d in docs:
                try:
                    ext.delete_custom_resource_definition(d["metadata"]["name"])
                except ApiException as e:
                    if e.status != 404:
                        raise
            deadline = time.monotonic() + timeout
            for d in docs:
                name, nudged = d["metadata"]["name"], time.monotonic()
                while True:
                    try:
                        ext.read_custom_resource_definition(name)
                    except ApiException as e:
                        if e.status == 404:
                            break
                        raise
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"CRD {name} still present")
                    if time.monotonic() - nudged > 5:
                        # A CRD finalizer that failed ("storage is (re)initializing") retries on the next
                        # update of the CRD: touch it instead of waiting a minute for the retry.
                        nudged = time.monotonic()
                        try:
                            ext.patch_custom_resource_definition(
                                name, {"metadata": {"annotations": {"embedops.dev/nudge": str(nudged)}}})
                        except ApiException:
                            pass
                    time.sleep(0.2)

    # --- generic apply ---------------------------------------------------------------------------
    def apply(self, docs, namespace: str | None = None, field_manager: str = "embedops-tests") -> list:
        """Server-side apply YAML documents (a list of dicts, a YAML string or a file path)."""
        from kubernetes import dynamic

        if isinstance(docs, Path) or (isinstance(docs, str) and "\n" not in docs and docs.endswith((".yaml", ".yml"))):
            docs = Path(docs).read_text()
        if isinstance(docs, str):
            docs = load_yaml(docs)
        out = []
        with self.api_client() as api:
            dyn = dynamic.DynamicClient(api)
            for d in docs:
                res = dyn.resources.get(api_version=d["apiVersion"], kind=d["kind"])
                ns = (d.get("metadata", {}).get("namespace") or namespace) if res.namespaced else None
                if ns:
                    d.setdefault("metadata", {})["namespace"] = ns
                out.append(res.server_side_apply(body=d, name=d["metadata"]["name"], namespace=ns,
                                                 field_manager=field_manager, force_conflicts=True))
        return out
