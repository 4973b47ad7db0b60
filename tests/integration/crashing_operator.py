"""`embedops-operator run` that SIGKILLs itself right after the API server answered its N-th write
(`EMBEDOPS_TEST_KILL_AFTER_WRITES=N`): an operator that dies between two API writes, at a point the test chooses.

Every write the operator sends goes through `runtime.client.Client._send` (apply, delete, status, events; dry-runs are
not writes), so counting there enumerates every point between two writes. Each write is logged to stderr
(`crashpoint: write N: PATCH /apis/...`) so a test can say after which write the operator died. Test-only: the
operator itself has no such switch.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from embedops_operator import cli
from embedops_operator.runtime import client as runtime_client


def install(after: int) -> None:
    send = runtime_client.Client._send
    lock = threading.Lock()
    count = 0

    def counted(self, method, path, query, *args, **kwargs):
        nonlocal count
        resp = send(self, method, path, query, *args, **kwargs)
        if method != "GET" and not any(k == "dryRun" for k, _ in query or []):
            with lock:
                count += 1
                n = count
            print(f"crashpoint: write {n}: {method} {path} -> {resp.status}", file=sys.stderr, flush=True)
            if n >= after:
                os.kill(os.getpid(), signal.SIGKILL)
        return resp

    runtime_client.Client._send = counted


if __name__ == "__main__":
    install(int(os.environ["EMBEDOPS_TEST_KILL_AFTER_WRITES"]))
    sys.exit(cli.main(sys.argv[1:]))
