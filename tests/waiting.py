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
