"""kstatus for tests: the Go library Flux's health checks use (sigs.k8s.io/cli-utils
pkg/kstatus/status.Compute), through the small CLI of localcluster's `kstatus` component."""
from __future__ import annotations

import json
import os
import subprocess

from localcluster.components import provided


def binary() -> str:
    path = provided("kstatus")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} missing; run `make cluster-binaries`")
    return str(path)


def kstatus(obj: dict) -> dict:
    """{"status": Current|InProgress|Failed|Terminating|NotFound|Unknown, "message": ...}"""
    out = subprocess.run([binary()], input=json.dumps(obj), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[0])
