"""Run a reconciled Deployment's server container as a local process.

kwok pods do not run containers, so to prove that what the operator renders is a working server
configuration we take the container's command, args and env from the Deployment the operator wrote and
run exactly that here. The only changes, each forced by running outside a pod:
  * volume mount paths are mapped to local folders (the model PVC to a folder holding the bundled
    models, emptyDirs to fresh temp folders), in args and env values alike;
  * `--hostname`/`--port` become 127.0.0.1 and a free port (a pod has its own network namespace);
  * `valueFrom.secretKeyRef` env is resolved from the Secret in the cluster.
Used by the demo without a real node (localcluster/demo.py) and tests/e2e/test_serving_path.py.
"""
from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def server_container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    for c in containers:
        if c["name"] == "server":
            return c
    return containers[0]


def local_command(deployment: dict, *, volume_dirs: dict[str, Path], scratch: Path, port: int,
                  secrets=None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for running the Deployment's server container locally.

    volume_dirs: volume name -> local folder (e.g. the model PVC's volume -> the models folder);
    volumes not listed get a fresh folder under `scratch`. secrets(name, key) -> str resolves
    secretKeyRef env values.
    """
    pod = deployment["spec"]["template"]["spec"]
    c = server_container(deployment)
    mapping: list[tuple[str, str]] = []
    for m in c.get("volumeMounts") or []:
        local = volume_dirs.get(m["name"])
        if local is None:
            local = scratch / m["name"]
            local.mkdir(parents=True, exist_ok=True)
        if m.get("subPath"):
            local = Path(local) / m["subPath"]
        mapping.append((m["mountPath"].rstrip("/"), str(local)))
    mapping.sort(key=lambda kv: -len(kv[0]))
    assert {v["name"] for v in pod.get("volumes") or []} >= {m["name"] for m in c.get("volumeMounts") or []}

    def remap(value: str) -> str:
        for mount, local in mapping:
            if value == mount or value.startswith(mount + "/"):
                return local + value[len(mount):]
        return value

    cmd = list(c.get("command") or [])
    args = [remap(a) for a in c.get("args") or []]
    for flag, val in (("--hostname", "127.0.0.1"), ("--port", str(port))):
        if flag in args:
            args[args.index(flag) + 1] = val
        else:
            args += [flag, val]
    if not cmd:
        raise ValueError("the server container has no command (image entrypoint); cannot run it locally")
    exe = Path(sys.executable).parent / cmd[0]
    argv = ([str(exe)] if exe.exists() else [shutil.which(cmd[0]) or cmd[0]]) + cmd[1:] + args

    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV")}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = remap(str(e["value"]))
        elif (e.get("valueFrom") or {}).get("secretKeyRef") and secrets:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets(ref["name"], ref["key"])
    # the pod's PORT/HOSTNAME-style env must not override the local choices
    env.pop("HOSTNAME", None)
    env["PORT"] = str(port)
    return argv, env


def secret_reader(core, namespace: str):
    def read(name: str, key: str) -> str:
        s = core.read_namespaced_secret(name, namespace)
        return base64.b64decode(s.data[key]).decode()
    return read


class LocalServer:
    def __init__(self, argv, env, log: Path, port: int):
        self.argv, self.env, self.log, self.port = argv, env, log, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LocalServer":
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
