"""The images build (cached) here, and the CPU server image serves under the security context the operator
renders for its pods: uid/gid 10001, read-only root, all capabilities dropped, no privilege escalation,
seccomp RuntimeDefault, an emptyDir at /tmp, the model read-only from a volume.

Skipped, with the reason, only where podman is missing or cannot run containers. Containers run with
--network=none, or --network=host bound to 127.0.0.1 only.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from localcluster import images as im

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "all-MiniLM-L6-v2"
TEXTS = ["Hello world", "Kubernetes operators reconcile custom resources into running workloads.",
         "What is the capital of France?", "Ünïcödé text and 中文字符 are tokenized too. " * 8]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def built():
    why = im.podman_usable()
    if why:
        pytest.skip(why)
    t0 = time.time()
    out = im.build(("server", "operator"))
    print(f"\nimages ready in {time.time() - t0:.1f}s: " + ", ".join(
        f"{i.ref} {i.size_bytes / 1e6:.0f} MB (archive {i.archive_bytes / 1e6:.0f} MB)" for i in out.values()))
    r = _podman("run", "--rm", "--network=none", "--entrypoint", "/bin/true", out["operator"].ref, check=False)
    if r.returncode != 0:
        pytest.skip(f"podman cannot run containers here: {r.stderr.strip()[-300:]}")
    return out


@pytest.fixture
def container():
    """Names of containers started by a test; removed after it."""
    names: list[str] = []
    yield lambda: names.append(f"embedops-test-{uuid.uuid4().hex[:8]}") or names[-1]
    for n in names:
        _podman("rm", "-f", "-t", "0", n, check=False)


def _pod_template() -> dict:
    """The Deployment pod template the operator renders for examples/cpu-ingestion.yaml (2 cores here)."""
    from embedops_operator import render
    from embedops_operator import spec as S

    doc = yaml.safe_load((ROOT / "examples" / "cpu-ingestion.yaml").read_text())
    doc["spec"]["accelerator"]["cpu"].update(cores=2, instructionSets=[])
    spec = S.EmbeddingServiceSpec.model_validate(doc["spec"])
    return render.pod_template(doc["metadata"]["name"], spec, render.Options())


def _podman_run_args(pod: dict, models: Path, port: int) -> tuple[list[str], list[str]]:
    """The pod's security context, volumes and env as podman flags, and the server's args on 127.0.0.1:port.
    Every setting is asserted to be one this mapping knows, so a change in render/pod.py shows up here."""
    ps = pod["spec"]["securityContext"]
    (c,) = pod["spec"]["containers"]
    sc = c["securityContext"]
    assert ps == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                  "seccompProfile": {"type": "RuntimeDefault"}}, ps
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                  "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}, sc
    flags = ["--user", f"{ps['runAsUser']}:{ps['runAsGroup']}", "--group-add", str(ps["fsGroup"]),
             # readOnlyRootFilesystem; podman would otherwise add its own tmpfs on /tmp, /var/tmp and /run
             "--read-only", "--read-only-tmpfs=false",
             "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
             # seccomp RuntimeDefault: podman's default profile, i.e. no --security-opt seccomp=...
             ]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for m in c["volumeMounts"]:
        v = volumes[m["name"]]
        if "emptyDir" in v:
            size = v["emptyDir"].get("sizeLimit", "2Gi").replace("Gi", "g").replace("Mi", "m")
            flags += ["--tmpfs", f"{m['mountPath']}:rw,exec,nosuid,nodev,mode=1777,size={size}"]
        elif "persistentVolumeClaim" in v:
            assert m.get("readOnly") and "subPath" not in m, m
            flags += ["-v", f"{models}:{m['mountPath']}:ro"]
        else:
            raise AssertionError(f"unmapped volume {v}")
    for e in c["env"]:
        assert "value" in e, e  # no secrets in this spec
        flags += ["-e", f"{e['name']}={e['value']}"]
    assert c["command"] == ["embedops-server"]
    args = list(c["args"])
    args[args.index("--hostname") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    return flags, args


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A models volume holding all-MiniLM-L6-v2 with an ONNX file made on the host by the project's exporter
    (the image has no torch to export with), and the same folder without ONNX."""
    from embedops_server.backends.onnx_export import export_onnx
    from embedops_server.core.model_info import load_model_info
    from localcluster.models import minilm_dir

    root = tmp_path_factory.mktemp("models")
    with_onnx = root / "with-onnx"
    folder = with_onnx / MODEL_NAME
    shutil.copytree(minilm_dir(), folder)
    export = root / "export"
    export.mkdir()
    onnx = export_onnx(load_model_info(folder), export)
    (folder / "onnx").mkdir()
    shutil.move(onnx, folder / "onnx" / "model.onnx")
    without = root / "without-onnx"
    shutil.copytree(minilm_dir(), without / MODEL_NAME)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    root.chmod(0o755)
    return {"with_onnx": with_onnx, "without_onnx": without}


def _wait_healthy(name: str, url: str, timeout: float = 300) -> None:
    from tests.server.conftest import wait_healthy

    def dead():
        state = _podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        return None if state == "running" else f"container {state}:\n{_podman('logs', name).stderr[-4000:]}"
    try:
        wait_healthy(url, timeout, dead=dead)
    except TimeoutError:
        raise AssertionError(f"not healthy after {timeout}s:\n{_podman('logs', name).stderr[-4000:]}") from None


def test_cpu_image_has_no_cuda_and_no_torch(built):
    img = built["server"]
    probe = (
        "import importlib.util, os, shutil\n"
        "bad = []\n"
        "for d, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [x for x in dirs if os.path.join(d, x) not in ('/proc', '/sys', '/dev')]\n"
        "    bad += [os.path.join(d, f) for f in files if f.startswith(('libcuda', 'libcudart', 'libcublas',\n"
        "            'libcudnn', 'libnccl', 'libnvrtc', 'libcufft', 'libcusparse'))]\n"
        "    bad += [os.path.join(d, x) for x in dirs if x == 'nvidia' and 'site-packages' in d]\n"
        "print('cuda', bad)\n"
        "print('torch', importlib.util.find_spec('torch'))\n"
        "import onnxruntime\n"
        "print('ort', onnxruntime.__version__, onnxruntime.get_available_providers())\n"
        "print('hf', shutil.which('hf'))\n"
    )
    r = _podman("run", "--rm", "--network=none", "--read-only", "--entrypoint", "/opt/venv/bin/python",
                img.ref, "-c", probe)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["cuda"] == "[]", lines["cuda"]
    assert lines["torch"] == "None"
    assert "CPUExecutionProvider" in lines["ort"]
    assert lines["hf"] == "/opt/venv/bin/hf"  # the operator's download init container runs `hf download`
    print(f"\n{img.ref}: {img.size_bytes / 1e6:.0f} MB, onnxruntime {lines['ort']}")


def test_server_image_serves_under_the_pod_security_context(built, models, container):
    import httpx
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from localcluster.models import minilm_dir

    pod = _pod_template()
    port = _free_port()
    flags, args = _podman_run_args(pod, models["with_onnx"], port)
    name = container()
    t0 = time.time()
    _podman("run", "-d", "--name", name, "--network=host", *flags, built["server"].ref, *args)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(name, url)
    ready = time.time() - t0
    assert _podman("exec", name, "id", "-u").stdout.strip() == "10001"

    ref = SentenceTransformer(str(minilm_dir()), device="cpu").encode(TEXTS, normalize_embeddings=True)
    tei = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=60).json())
    r = httpx.post(url + "/v1/embeddings", json={"input": TEXTS, "model": MODEL_NAME}, timeout=60)
    assert r.status_code == 200, r.text
    oai = np.array([d["embedding"] for d in r.json()["data"]])
    for got in (tei, oai):
        assert got.shape == ref.shape
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.9999, cos
    info = httpx.get(url + "/info", timeout=10).json()
    assert info["model_id"].endswith(MODEL_NAME), info

    # SIGTERM (podman stop; kubelet sends it after the preStop sleep) ends it cleanly within the grace period
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    t1 = time.time()
    _podman("stop", "-t", str(grace), name, timeout=grace + 30)
    stopped = time.time() - t1
    code = int(_podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout)
    logs = _podman("logs", name).stderr
    # uvicorn re-raises the SIGTERM it drained on: 143 (128 + 15) is the clean exit; 137 would be the SIGKILL
    assert code in (0, 143) and stopped < grace, (code, stopped, logs[-3000:])
    assert "draining" in logs and "Traceback" not in logs, logs[-3000:]
    print(f"\nhealthy {ready:.1f}s after podman run; stopped in {stopped:.1f}s (exit {code}, grace {grace}s)")


def test_server_image_without_onnx_fails_with_a_clear_error(built, models, container):
    pod = _pod_template()
    flags, args = _podman_run_args(pod, models["without_onnx"], _free_port())
    name = container()
    _podman("run", "-d", "--name", name, "--network=host", *flags, built["server"].ref, *args)
    code = int(_podman("wait", name, timeout=180).stdout.strip().splitlines()[-1])
    logs = _podman("logs", name).stderr
    assert code == 3, (code, logs[-3000:])
    assert "Traceback" not in logs, logs[-3000:]
    lines = [json.loads(x) for x in logs.splitlines() if "has no ONNX file" in x]  # --json-output
    assert len(lines) == 1 and lines[0]["level"] == "ERROR", logs[-3000:]
    assert "torch is not installed in this image: ship onnx/model.onnx" in lines[0]["message"], lines


def test_operator_image_runs_as_10001(built):
    ref = built["operator"].ref
    common = ["run", "--rm", "--network=none", "--read-only", "--cap-drop", "ALL",
              "--security-opt", "no-new-privileges"]
    assert _podman(*common, "--entrypoint", "/usr/bin/id", ref, "-u").stdout.strip() == "10001"
    r = _podman(*common, ref, "crd")
    crd = yaml.safe_load(r.stdout)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "EmbeddingService"
    assert "usage" in _podman(*common, ref, "--help").stdout.lower()


@pytest.fixture
def containerd():
    """A private containerd (CRI off) on a socket in a temp folder, stopped by its pid afterwards."""
    missing = [b for b in ("containerd", "ctr") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{missing} not installed (scripts/host-packages.sh installs containerd)")
    d = Path(tempfile.mkdtemp(prefix="ctd-", dir="/tmp"))
    sock = d / "containerd.sock"
    (d / "config.toml").write_text(
        f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n')
    log = open(d / "containerd.log", "w")
    proc = subprocess.Popen(["containerd", "--config", str(d / "config.toml")], stdout=log, stderr=log)
    try:
        deadline = time.time() + 30
        while subprocess.run(["ctr", "--address", str(sock), "version"], capture_output=True).returncode != 0:
            assert proc.poll() is None and time.time() < deadline, (d / "containerd.log").read_text()[-2000:]
            time.sleep(0.2)
        yield str(sock)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def test_archives_import_into_containerd(built, containerd):
    t0 = time.time()
    assert sorted(im.import_into_containerd(containerd, built)) == sorted(i.ref for i in built.values())
    took = time.time() - t0
    assert im.import_into_containerd(containerd, built) == []  # same ref and digest: nothing to do
    ls = subprocess.run(["ctr", "--address", containerd, "-n", "k8s.io", "images", "ls", "-q"],
                        capture_output=True, text=True, check=True).stdout.split()
    assert set(ls) == {i.ref for i in built.values()}  # the archive's ref is the tag podman built
    # unpacked and runnable by containerd's runc: the operator's entry point as uid 10001 (no network)
    r = subprocess.run(["ctr", "--address", containerd, "-n", "k8s.io", "run", "--rm", built["operator"].ref,
                        f"t-{uuid.uuid4().hex[:6]}", "id", "-u"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "10001", r.stdout + r.stderr
    print(f"\nimported {len(built)} archives in {took:.1f}s")


@pytest.mark.opt_in
@pytest.mark.skipif(os.environ.get("EMBEDOPS_CUDA_IMAGE") != "1",
                    reason="the CUDA image is ~6 GB and ~10 min to build: set EMBEDOPS_CUDA_IMAGE=1 to test it")
def test_cuda_image_exports_and_serves_on_cpu(models, container):
    """The CUDA image has torch: a folder without ONNX is exported into the /tmp emptyDir at start (read-only
    root) and served. No GPU here, so it runs on CPU; on a GPU node the same image picks torch on CUDA."""
    import httpx
    import numpy as np

    why = im.podman_usable()
    if why:
        pytest.skip(why)
    img = im.build(("server-cuda",))["server-cuda"]
    probe = "import torch; print(torch.__version__, torch.version.cuda)"
    r = _podman("run", "--rm", "--network=none", "--entrypoint", "/opt/venv/bin/python", img.ref, "-c", probe)
    assert r.stdout.split()[1].startswith("1"), r.stdout  # a CUDA build of torch
    pod = _pod_template()
    port = _free_port()
    flags, args = _podman_run_args(pod, models["without_onnx"], port)
    name = container()
    _podman("run", "-d", "--name", name, "--network=host", *flags, img.ref, *args)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(name, url, timeout=600)
    info = httpx.get(url + "/info", timeout=10).json()
    assert info["backend"] == "onnxruntime" and info["device"] == "cpu", info
    v = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS[:1]}, timeout=60).json())
    assert v.shape == (1, 384)
    _podman("stop", "-t", str(pod["spec"]["terminationGracePeriodSeconds"]), name, timeout=120)
    assert int(_podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout) in (0, 143)
    print(f"\n{img.ref}: {img.size_bytes / 1e9:.2f} GB, torch {r.stdout.strip()}")
