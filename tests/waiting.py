"""Polling helper shared by the cluster, integration and e2e tests."""
from __future__ import annotations

import time


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
