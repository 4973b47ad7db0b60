"""Polling helper shared by the cluster, integration and e2e tests."""
from __future__ import annotations

import threading
import time

import urllib3
from kubernetes import watch


def wait_for(fn, timeout=60.0, interval=0.25, what="condition"):
    """Call fn until it returns something truthy; fail with the last value seen after timeout seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


class _Raised:
    """What a poll that raised counts as: falsy (not yet), shown as the exception in the timeout message."""

    def __init__(self, exc: Exception):
        self.exc = exc

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return repr(self.exc)


def wait_until(what, fn, timeout=60.0, interval=0.25):
    """wait_for for API calls that may fail while a cluster or an operator comes back: an exception from fn
    counts as "not yet" and the last one is reported on timeout."""
    def attempt():
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last error
            return _Raised(exc)
    return wait_for(attempt, timeout, interval, what)


class ReplicasWatch:
    """Every value a Deployment's spec.replicas takes, from a watch (each write is an event: nothing between two
    samples is missed). `steps()` drops repeats: [1, 2, 1] for a scale up and back."""

    def __init__(self, apps, namespace: str, name: str, timeout_seconds: int = 600):
        self.seen: list[int] = []
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(apps, namespace, name, timeout_seconds), daemon=True)
        self._thread.start()

    def _run(self, apps, namespace, name, timeout_seconds):
        try:
            for ev in self._watch.stream(apps.list_namespaced_deployment, namespace,
                                         field_selector=f"metadata.name={name}", timeout_seconds=timeout_seconds):
                self.seen.append(ev["object"].spec.replicas)
        except urllib3.exceptions.ProtocolError:  # stop() closed the stream under it
            pass

    def stop(self) -> list[int]:
        self._watch.stop()
        self._thread.join(10)
        return self.seen

    def steps(self) -> list[int]:
        return [v for i, v in enumerate(self.seen) if i == 0 or v != self.seen[i - 1]]
