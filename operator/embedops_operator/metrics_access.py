"""Who may read the operator's /metrics: the Kubernetes API server decides, as it does for a kubelet's or a
controller-runtime manager's metrics.

The operator's metrics name every EmbeddingService of every namespace it watches (conditions, replicas,
restarts), so an open port tells any pod of the cluster what each tenant runs. Each request must carry a bearer
token; a TokenReview says whose it is, and a SubjectAccessReview whether that user may ``get`` the
non-resource URL (``/metrics``), which the chart grants through its ``metrics-reader`` ClusterRole. Answers are
kept for a short while per token (a scrape every 30 s costs no review after the first), allowed ones longer
than refused ones, as Kubernetes' delegating authenticator and authorizer do.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("embedops.metrics")

ALLOW_TTL = 60.0   # seconds an allowed token is trusted without a new review
DENY_TTL = 10.0    # and a refused one refused (short: a RoleBinding just created takes effect soon)
MAX_CACHED = 1024  # tokens remembered; past that the oldest answers go first


@dataclass(frozen=True)
class Decision:
    """An HTTP status (200, 401, 403, 503) and, when not 200, the message the client reads."""
    status: int
    message: str = ""


class KubernetesAccessReview:
    """``decide(authorization_header, path) -> Decision`` through the API server's TokenReview and
    SubjectAccessReview. ``api_client``: a ``kubernetes.client.ApiClient`` allowed to create both (the chart's
    ClusterRole)."""

    def __init__(self, api_client, clock: Callable[[], float] = time.monotonic):
        from kubernetes import client as k8s

        self._authn = k8s.AuthenticationV1Api(api_client)
        self._authz = k8s.AuthorizationV1Api(api_client)
        self._clock = clock
        self._cache: dict[tuple[str, str], tuple[float, Decision]] = {}
        self._lock = threading.Lock()
        self.reviews = 0  # TokenReviews sent (tests read it: a cached answer sends none)

    def decide(self, authorization: str | None, path: str) -> Decision:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Decision(401, "a bearer token is required (the scraper's ServiceAccount token)")
        key = (hashlib.sha256(token.encode()).hexdigest(), path)  # the token itself is never kept
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit and hit[0] > now:
                return hit[1]
        try:
            decision = self._review(token, path)
        except Exception as exc:  # the API server unreachable or refusing us: say so, remember nothing
            log.warning("cannot review a /metrics request: %s", exc)
            return Decision(503, f"cannot review the token with the Kubernetes API server: {type(exc).__name__}")
        with self._lock:
            if len(self._cache) >= MAX_CACHED:
                for k, _ in sorted(self._cache.items(), key=lambda kv: kv[1][0])[: MAX_CACHED // 4]:
                    del self._cache[k]
            self._cache[key] = (now + (ALLOW_TTL if decision.status == 200 else DENY_TTL), decision)
        return decision

    def _review(self, token: str, path: str) -> Decision:
        from kubernetes import client as k8s

        self.reviews += 1
        review = self._authn.create_token_review(k8s.V1TokenReview(spec=k8s.V1TokenReviewSpec(token=token)))
        st = review.status
        if not st or not st.authenticated or not st.user:
            return Decision(401, "the bearer token is not valid (TokenReview: not authenticated)")
        user = st.user
        sar = self._authz.create_subject_access_review(k8s.V1SubjectAccessReview(spec=k8s.V1SubjectAccessReviewSpec(
            user=user.username, groups=user.groups, uid=user.uid, extra=user.extra,
            non_resource_attributes=k8s.V1NonResourceAttributes(path=path, verb="get"))))
        if sar.status and sar.status.allowed:
            return Decision(200)
        return Decision(403, f'{user.username} may not get {path} (grant it the chart\'s "metrics-reader" '
                             "ClusterRole)")
