"""The runtime the operator's controller runs on, kept apart from what it reconciles: it knows no
EmbeddingService, renders nothing and imports nothing from the operator.

- `client`: the API client (requests over the official kubernetes client, the API server's availability, writes
  fenced by leadership, list pages and watch streams); the operator's `apply.Kube` names its kinds.
- `watchcache`: one list+watch cache per kind (and namespace), read instead of the API server.
- `cachedkube`: the client's interface over those caches (reads from them, writes through).
- `workqueue` and `delayed`: the keys to reconcile, each waiting once and never worked on twice at once; back-offs
  and coalescing windows as entries of one heap served by one thread.
- `leader`: leader election on a coordination.k8s.io Lease, with the fencing every write checks.

kopf starts the process, logs in and answers liveness (handlers.py); docs/operator.md says why the rest is here.
"""
