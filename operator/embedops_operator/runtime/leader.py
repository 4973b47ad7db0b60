"""Leader election on a `coordination.k8s.io/v1` Lease, so that several replicas can run and one reconciles.

The controller-runtime / client-go convention, written small on `CoordinationV1Api`:

* A candidate reads the Lease. It takes it when there is none (create), when it is released (no holder), or
  when the holder has not renewed it for `lease_duration` seconds *as observed by this candidate's own
  monotonic clock* (the time it first saw the current holder/renewTime pair); clocks of different nodes are
  never compared. Every write is a replace carrying the resourceVersion that was read, so of two candidates
  racing for an expired Lease exactly one wins (the other gets 409 Conflict and stays a follower).
* The leader renews every `retry_period` seconds (one PUT with the resourceVersion of its own last write; a
  GET only after a conflict). When no renewal has succeeded for `renew_deadline` seconds (< lease_duration)
  it has lost leadership: the process exits non-zero at once (the kubelet restarts it as a follower), so it
  stops writing before any follower can take over.
* On a graceful stop (SIGTERM) the leader releases the Lease (empty holder), so a follower takes over on its
  next poll instead of after `lease_duration`.

Worst case from the leader's death to a follower holding the Lease: lease_duration + 2 × retry_period (the
follower sees the last renewal up to one poll late, and polls once more after expiry); with client-go's defaults
15/10/2 s that is 19 s, best case 13 s.

Fencing: between the renew deadline passing and the process exiting, the reconcile threads could still write.
Every write the operator's client sends first asks `holds()` (client.Client.fence): once this candidate has gone
`renew_deadline` without a successful renewal, writes are refused (LeadershipLost) before they reach the wire.

Why not `kubernetes.leaderelection` (the official client has a LeaseLock): it uses the process-wide default
ApiClient (not the operator's configured one), calls sys.exit() on bad settings, blocks a thread with no way
to stop or release, and its renew does a GET before every PUT.

kopf's own peering stays off (`standalone`): kopf is started only while this process holds the Lease.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:  # the kubernetes client is imported on use: `embedops-operator render` does not need it
    from kubernetes import client as k8s

log = logging.getLogger("embedops.leader")

LOST_EXIT_CODE = 1


def default_identity() -> str:
    """Unique per process: the pod's name (POD_NAME from the downward API, else the hostname) plus a random
    suffix, so a restarted container never mistakes its predecessor's Lease for its own."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def default_namespace() -> str:
    """POD_NAMESPACE (downward API), else the in-cluster service account's namespace, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


@dataclass
class ElectionConfig:
    name: str = "embedops-operator"
    namespace: str = "default"
    identity: str = field(default_factory=default_identity)
    lease_duration: float = 15.0  # client-go's (and controller-runtime's) defaults
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def validate(self) -> None:
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError("leader election needs lease-duration > renew-deadline > retry-period > 0 "
                             f"(got {self.lease_duration}/{self.renew_deadline}/{self.retry_period})")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Elector:
    """One candidate. Synchronous API calls (run them in a thread from asyncio); `clock` is injectable."""

    def __init__(self, api_client: "k8s.ApiClient", config: ElectionConfig,
                 clock: Callable[[], float] = time.monotonic):
        from kubernetes import client as k8s

        config.validate()
        self.config = config
        self.k8s = k8s
        self.api = k8s.CoordinationV1Api(api_client)
        self.clock = clock
        self._lease: Any = None          # the last Lease read or written (its resourceVersion is the guard)
        self._observed: tuple | None = None  # (holder, renewTime, resourceVersion) last seen, and when
        self._observed_at = 0.0
        self.is_leader = False
        self.holder: str | None = None   # last holder seen (for logs)
        self.renewed_at: float | None = None  # when this candidate last acquired or renewed the Lease (clock())

    def holds(self) -> bool:
        """Whether this candidate may still write: it leads and its last renewal is within renew_deadline."""
        return self.is_leader and self.renewed_at is not None and \
            self.clock() - self.renewed_at < self.config.renew_deadline

    @property
    def timeout(self) -> float:
        """Per-request timeout: a hung connection must not hold the leader past its renew deadline."""
        return max(1.0, self.config.renew_deadline / 2)

    def _spec(self, acquire_time: dt.datetime | None, transitions: int) -> "k8s.V1LeaseSpec":
        now = _now()
        return self.k8s.V1LeaseSpec(holder_identity=self.config.identity,
                                    lease_duration_seconds=int(round(self.config.lease_duration)),
                                    acquire_time=acquire_time or now, renew_time=now, lease_transitions=transitions)

    def _observe(self, lease: Any) -> None:
        spec = lease.spec or self.k8s.V1LeaseSpec()
        key = (spec.holder_identity, spec.renew_time, lease.metadata.resource_version)
        if key != self._observed:
            self._observed, self._observed_at = key, self.clock()
        self.holder = spec.holder_identity

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this candidate holds the Lease afterwards. Never raises for API errors."""
        from kubernetes.client.rest import ApiException

        c = self.config
        try:
            if self.is_leader and self._lease is not None:
                # renew from our own last write: one PUT; a conflict means someone else wrote -> re-read below
                try:
                    return self._write(self._lease, self._spec(self._lease.spec.acquire_time,
                                                               self._lease.spec.lease_transitions or 0))
                except ApiException as exc:
                    if exc.status != 409:
                        raise
            try:
                lease = self.api.read_namespaced_lease(c.name, c.namespace, _request_timeout=self.timeout)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                body = self.k8s.V1Lease(metadata=self.k8s.V1ObjectMeta(name=c.name, namespace=c.namespace),
                                        spec=self._spec(None, 0))
                try:
                    self._lease = self.api.create_namespaced_lease(c.namespace, body, _request_timeout=self.timeout)
                except ApiException as exc2:
                    if exc2.status == 409:  # another candidate created it first
                        self.is_leader = False
                        return False
                    raise
                self._observe(self._lease)
                self.is_leader = True
                return True
            self._observe(lease)
            spec = lease.spec or self.k8s.V1LeaseSpec()
            holder = spec.holder_identity or ""
            if holder and holder != c.identity:
                duration = spec.lease_duration_seconds or c.lease_duration
                if self.clock() < self._observed_at + duration:
                    self.is_leader = False
                    return False  # held, and renewed within its duration as far as we have seen
            transitions = spec.lease_transitions or 0
            if holder == c.identity:
                new = self._spec(spec.acquire_time, transitions)
            else:
                new = self._spec(None, transitions + 1)
            return self._write(lease, new)
        except ApiException as exc:
            if exc.status == 409:
                self.is_leader = False
                return False
            log.warning("lease %s/%s: %s %s", c.namespace, c.name, exc.status, exc.reason)
        except Exception as exc:  # noqa: BLE001 - connection refused/reset, timeouts: retried next period
            log.warning("lease %s/%s: %s", c.namespace, c.name, f"{type(exc).__name__}: {exc}"[:300])
        return False

    def _write(self, lease: Any, spec: "k8s.V1LeaseSpec") -> bool:
        c = self.config
        body = self.k8s.V1Lease(metadata=self.k8s.V1ObjectMeta(name=c.name, namespace=c.namespace,
                                                               resource_version=lease.metadata.resource_version),
                                spec=spec)
        self._lease = self.api.replace_namespaced_lease(c.name, c.namespace, body, _request_timeout=self.timeout)
        self._observe(self._lease)
        self.is_leader = True
        return True

    def release(self) -> bool:
        """Give the Lease up (graceful stop): empty holder, 1 s duration; a follower takes it on its next poll.
        A conflict (a renewal that was in flight landed first) is retried once from a fresh read, only while
        the Lease is still ours."""
        from kubernetes.client.rest import ApiException

        if not self.is_leader or self._lease is None:
            return False
        c = self.config
        lease = self._lease
        try:
            for attempt in (1, 2):
                spec = self.k8s.V1LeaseSpec(holder_identity=None, lease_duration_seconds=1, acquire_time=_now(),
                                            renew_time=_now(), lease_transitions=lease.spec.lease_transitions or 0)
                body = self.k8s.V1Lease(metadata=self.k8s.V1ObjectMeta(
                    name=c.name, namespace=c.namespace, resource_version=lease.metadata.resource_version), spec=spec)
                try:
                    self.api.replace_namespaced_lease(c.name, c.namespace, body, _request_timeout=self.timeout)
                    break
                except ApiException as exc:
                    if exc.status != 409 or attempt == 2:
                        raise
                    lease = self.api.read_namespaced_lease(c.name, c.namespace, _request_timeout=self.timeout)
                    if (lease.spec and lease.spec.holder_identity) != c.identity:
                        return False  # not ours any more: nothing to release
        except Exception as exc:  # noqa: BLE001 - it then expires after lease_duration
            log.warning("could not release lease %s/%s: %s", c.namespace, c.name, exc)
            return False
        finally:
            self.is_leader = False
        log.info("released lease %s/%s", c.namespace, c.name)
        return True

    # ------------------------------------------------------------------ asyncio drivers
    async def acquire(self) -> None:
        """Poll every retry_period until this candidate holds the Lease."""
        c = self.config
        log.info("%s: waiting to lead (lease %s/%s)", c.identity, c.namespace, c.name)
        last_holder = None
        while not await asyncio.to_thread(self.try_acquire_or_renew):
            if self.holder != last_holder:
                log.info("%s: following %s", c.identity, self.holder or "(nobody)")
                last_holder = self.holder
            await asyncio.sleep(c.retry_period)
        self.renewed_at = self.clock()
        log.info("%s: became leader (lease %s/%s)", c.identity, c.namespace, c.name)

    async def keep(self) -> None:
        """Renew until renew_deadline passes without a successful renewal, then return (leadership lost)."""
        c = self.config
        last_ok = self.clock()
        while True:
            await asyncio.sleep(c.retry_period)
            left = last_ok + c.renew_deadline - self.clock()
            try:
                ok = await asyncio.wait_for(asyncio.to_thread(self.try_acquire_or_renew), timeout=max(0.1, left))
            except asyncio.TimeoutError:
                ok = False
            if ok:
                last_ok = self.renewed_at = self.clock()
            elif not self.is_leader and self.holder and self.holder != c.identity:
                log.error("%s: lease %s/%s taken by %s", c.identity, c.namespace, c.name, self.holder)
                return
            elif self.clock() - last_ok >= c.renew_deadline:
                log.error("%s: could not renew lease %s/%s for %.0f s", c.identity, c.namespace, c.name,
                          self.clock() - last_ok)
                return


# ---------------------------------------------------------------------------------------------- CLI glue

def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ElectionConfig
    p.add_argument("--leader-elect", action="store_true",
                   help="run as one of several replicas: reconcile only while holding a coordination.k8s.io "
                        "Lease (the chart sets this); without it the operator runs alone (local `run`)")
    p.add_argument("--leader-election-id", default=d.name, help="the Lease's name (default %(default)s)")
    p.add_argument("--leader-election-namespace", default=None,
                   help="the Lease's namespace (default: POD_NAMESPACE, the in-cluster namespace, or default)")
    p.add_argument("--leader-election-lease-duration", type=float, default=d.lease_duration,
                   help="seconds a follower waits after the leader's last renewal (default %(default)s)")
    p.add_argument("--leader-election-renew-deadline", type=float, default=d.renew_deadline,
                   help="seconds without a successful renewal before the leader gives up and exits 1 "
                        "(default %(default)s)")
    p.add_argument("--leader-election-retry-period", type=float, default=d.retry_period,
                   help="seconds between renewals / acquisition attempts (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> ElectionConfig:
    cfg = ElectionConfig(name=args.leader_election_id,
                         namespace=args.leader_election_namespace or default_namespace(),
                         lease_duration=args.leader_election_lease_duration,
                         renew_deadline=args.leader_election_renew_deadline,
                         retry_period=args.leader_election_retry_period)
    cfg.validate()
    return cfg


async def _serve_healthz(endpoint: str):
    """While following, kopf (which serves the liveness endpoint) is not running: answer /healthz here so the
    kubelet does not restart a healthy follower."""
    from urllib.parse import urlparse

    from aiohttp import web

    url = urlparse(endpoint)
    app = web.Application()
    app.router.add_get(url.path or "/", lambda _: web.json_response({"leader": False}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname or "0.0.0.0", url.port or 80).start()
    return runner


def run(operator: Callable[..., Awaitable[None]], args: argparse.Namespace, api_client=None) -> int:
    """Run `operator(liveness_endpoint=..., stop_flag=...)` (kopf.operator with its other arguments bound):
    directly without --leader-elect, else only while holding the Lease. Returns the exit code."""
    liveness = args.liveness or None
    if not getattr(args, "leader_elect", False):
        asyncio.run(operator(liveness_endpoint=liveness))
        return 0
    if api_client is None:
        from kubernetes import client as k8s

        from .client import Client

        api_client = k8s.ApiClient(Client.configuration())
    elector = Elector(api_client, config_from_args(args))
    from .client import Client

    Client.fence = elector.holds  # every write of the operator's client checks it first

    async def main() -> int:
        health = await _serve_healthz(liveness) if liveness else None
        try:
            await elector.acquire()
        finally:
            if health is not None:
                await health.cleanup()
        keeper = asyncio.create_task(elector.keep())
        keeper.add_done_callback(lambda t: None if t.cancelled() else _lost(elector))
        try:
            await operator(liveness_endpoint=liveness)  # kopf handles SIGTERM/SIGINT itself
        finally:
            keeper.cancel()
        # kopf stopped on its own (SIGTERM/SIGINT): hand the Lease over instead of letting it expire
        await asyncio.to_thread(elector.release)
        return 0

    return asyncio.run(main())


def _lost(elector: Elector) -> None:
    """Leadership lost: stop at once, before a non-leader could write anything. Exiting non-zero lets the
    kubelet restart the container, which then follows (controller-runtime does the same)."""
    log.error("%s: leader election lost; exiting", elector.config.identity)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    sys.stderr.flush()
    os._exit(LOST_EXIT_CODE)
