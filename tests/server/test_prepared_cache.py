"""`embedops-server prepare` and serving from what it prepared, on a model in the Hub's ONNX layout
(onnx/model.onnx with its weights in external data) on a read-only folder, as the pod sees the model PVC.

Small random XLM-R models stand in for bge-m3 (bench/real_size.py has the real size; bench/sizing.py measures
it): what matters here is the files, the read-only volumes and what is loaded, not the size.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from embedops_server.backends import onnx_export
from embedops_server.backends.ort_backend import SMALL_SESSION_MAX_BYTES, OrtBackend
from embedops_server.core.model_info import ModelError, load_model_info, model_commit
from bench.m3_model import build_m3_folder

from .conftest import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` seen through a read-only bind mount (what a pod gets from a volume mounted readOnly; file
    modes would not do: the tests run as root, which ignores them)."""
    view = path.with_name(path.name + ".ro")
    view.mkdir()
    r = subprocess.run(f"mount --bind {path} {view} && mount -o remount,bind,ro {view}", shell=True,
                       capture_output=True, text=True)
    if r.returncode != 0:
        view.rmdir()
        pytest.skip(f"a read-only bind mount needs root here: {r.stderr.strip()}")
    try:
        yield view
    finally:
        onnx_export.release()  # this process's holds on cache entries under the mount (a server's, for its life)
        subprocess.run(["umount", str(view)], check=False)
        view.rmdir()


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    """A tiny bge-m3-layout folder whose ONNX graph ships as onnx/model.onnx + onnx/model.onnx_data, on a
    read-only folder (the model PVC is mounted read-only)."""
    import onnx

    root = tmp_path_factory.mktemp("hub")
    folder = build_m3_folder(root / "bge-m3-tiny", hidden=64, layers=2)
    scratch = tmp_path_factory.mktemp("export")
    graph = onnx_export.export_onnx(load_model_info(folder), scratch)
    (folder / "onnx").mkdir()
    model = onnx.load(str(graph))
    onnx.save_model(model, str(folder / "onnx" / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=0)
    with read_only(folder) as view:
        yield view


def test_graph_bytes_count_external_data(hub_folder):
    graph = hub_folder / "onnx" / "model.onnx"
    files = onnx_export.graph_files(graph)
    assert [f.name for f in files] == ["model.onnx", "model.onnx_data"]
    assert onnx_export.graph_bytes(graph) == sum(f.stat().st_size for f in files)
    assert graph.stat().st_size < onnx_export.graph_bytes(graph) / 10  # the graph file alone is not the model


def test_a_model_with_external_data_is_not_judged_small(hub_folder, tmp_path, monkeypatch):
    """The side-by-side and one-query sessions each hold another copy of the weights, so they are for small
    models only; a folder whose weights are external data must count them (bge-m3's model.onnx is 0.7 MB)."""
    graph = hub_folder / "onnx" / "model.onnx"
    monkeypatch.setattr("embedops_server.backends.ort_backend.SMALL_SESSION_MAX_BYTES",
                        graph.stat().st_size * 2)  # bigger than the graph file, smaller than graph + data
    be = OrtBackend(load_model_info(hub_folder), threads=2, cache=str(tmp_path))
    assert be.model_bytes > graph.stat().st_size * 2
    assert be.narrow_session is None and be.small_session is None and be.parallel_forwards == 1
    assert SMALL_SESSION_MAX_BYTES == 200 << 20


def _prepare(folder: Path, cache: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embedops_server.cli", "prepare", "--model-id", str(folder),
         "--backend", "onnxruntime", "--num-threads", "1", "--onnx-cache", str(cache), *extra],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO / "server"), **(env or {})})


def test_prepare_quantizes_a_read_only_folder_and_the_server_loads_only_the_int8_graph(hub_folder, tmp_path):
    """The quantizer writes `<model>-inferred.onnx` beside its input: on the read-only model folder that
    failed the pod at start. `prepare` makes the int8 graph and the gate's result into the cache; a server
    on that cache, mounted read-only, loads the int8 graph without a float32 session and serves."""
    cache = tmp_path / "cache"
    term = tmp_path / "termination-log"
    r = _prepare(hub_folder, cache, "--quantize", "int8", "--int8-min-cosine", "0.9",
                 env={"EMBEDOPS_TERMINATION_LOG": str(term)})
    assert r.returncode == 0, r.stderr[-3000:]
    entry = next(cache.glob("*/prepared.json")).parent
    summary = json.loads((entry / "prepared.json").read_text())
    assert summary["dtype"] == "int8" and summary["int8_cosine"] >= 0.9 and summary["peak_rss_mb"] > 0
    assert (entry / "model.int8.onnx").exists() and (entry / "model.int8.onnx.gate.json").exists()
    assert not list(hub_folder.rglob("*-inferred*")), "nothing may be written beside the model"
    assert term.read_text().startswith("prepared ") and '"int8_cosine"' in term.read_text()

    # a second prepare on a prepared cache changes nothing but its records of the last start (what a pruner reads)
    made = ("prepared.json", onnx_export.USED_FILE)
    before = {p: p.stat().st_mtime_ns for p in entry.iterdir()}
    assert _prepare(hub_folder, cache, "--quantize", "int8", "--int8-min-cosine", "0.9").returncode == 0
    assert {p: p.stat().st_mtime_ns for p in entry.iterdir() if p.name not in made} == \
        {p: t for p, t in before.items() if p.name not in made}

    with read_only(cache) as cache:
        loaded: list[str] = []
        import embedops_server.backends.ort_backend as ob

        real = ob.OrtBackend._session

        def spy(self, path, *a, **kw):
            loaded.append(Path(path).name if not isinstance(path, bytes) else "<bytes>")
            return real(self, path, *a, **kw)

        ob.OrtBackend._session = spy
        try:
            import tokenizers

            tok = tokenizers.Tokenizer.from_file(str(hub_folder / "tokenizer.json"))
            be = OrtBackend(load_model_info(hub_folder), threads=1, quantize="int8", cache=str(cache),
                            int8_min_cosine=0.9, tokenizer=tok)
        finally:
            ob.OrtBackend._session = real
        assert "model.onnx" not in loaded, f"the float32 graph was loaded again: {loaded}"
        assert loaded[0] == "model.int8.onnx" and be.int8_cosine == summary["int8_cosine"]
        # the same cache, read-only, under a stricter gate: refused from the record, no float32 reload
        with pytest.raises(ModelError, match="quality gate"):
            OrtBackend(load_model_info(hub_folder), threads=1, quantize="int8", cache=str(cache),
                       int8_min_cosine=0.99999999, tokenizer=tok)
        # and the whole server on it, over HTTP
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "embedops_server.cli", "--model-id", str(hub_folder), "--port", str(port),
             "--hostname", "127.0.0.1", "--backend", "onnxruntime", "--quantize", "int8",
             "--int8-min-cosine", "0.9", "--num-threads", "1", "--onnx-cache", str(cache)],
            env={**os.environ, "PYTHONPATH": str(REPO / "server")}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", timeout=120,
                         dead=lambda: proc.poll() is not None and proc.stderr.read()[-2000:])
            v = httpx.post(f"http://127.0.0.1:{port}/embed_hybrid", json={"inputs": ["hello world"]}).json()
            assert len(v[0]["dense"]) == 64 and isinstance(v[0]["sparse"], list) and len(v[0]["colbert"]) == 3
            info = httpx.get(f"http://127.0.0.1:{port}/info").json()
            assert info["model_dtype"] == "int8" and info["int8_cosine"] == summary["int8_cosine"]
        finally:
            proc.terminate()
            proc.wait(30)


def test_a_read_only_cache_without_the_entry_says_to_prepare(hub_folder, tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    with read_only(cache) as cache:
        with pytest.raises(ModelError, match="embedops-server prepare"):
            OrtBackend(load_model_info(hub_folder), threads=1, quantize="int8", cache=str(cache))


def test_an_export_over_many_files_is_packed_into_one_data_file(tmp_path, monkeypatch):
    """torch writes a > 2 GB model's weights one file per tensor (bge-m3: ~390 files); the export keeps one
    graph file and one data file. Forced here on a tiny model by exporting with external data."""
    import onnx
    import torch

    folder = build_m3_folder(tmp_path / "m", hidden=64, layers=2)
    real_export = torch.onnx.export

    def export_with_external_data(*a, **kw):  # what torch does past protobuf's 2 GB limit
        real_export(*a, **kw)
        path = a[2]
        m = onnx.load(path)
        onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)

    monkeypatch.setattr(torch.onnx, "export", export_with_external_data)
    out = tmp_path / "cache"
    out.mkdir()
    graph = onnx_export.export_onnx(load_model_info(folder), out)
    assert sorted(p.name for p in out.iterdir()) == ["model.eager.onnx", "model.eager.onnx.data"]
    assert [f.name for f in onnx_export.graph_files(graph)] == ["model.eager.onnx", "model.eager.onnx.data"]
    be = OrtBackend(load_model_info(folder), threads=1, cache=str(tmp_path / "c2"))
    ref = OrtBackend(load_model_info(folder), threads=1, cache=str(tmp_path / "c2"))
    ids = np.array([[0, 100, 200, 2]])
    from embedops_server.core.batch import Batch

    b = Batch(ids, np.ones_like(ids), np.zeros_like(ids), np.array([4]))
    np.testing.assert_allclose(be.forward(b).pooled, ref.forward(b).pooled, rtol=1e-5)
    packed = onnx.load(str(graph))
    assert len(packed.graph.initializer) > 10


def test_max_input_length_bounds_inputs_and_is_refused_above_the_models(hub_folder, tmp_path):
    from embedops_server.service import build_service
    from embedops_server.settings import Settings

    s = Settings(model_id=str(hub_folder), backend="onnxruntime", num_threads=1, onnx_cache=str(tmp_path),
                 max_input_length=16)
    svc = build_service(s)
    try:
        assert svc.max_input_length == 16 and svc.engine.max_input_length == 16
    finally:
        svc.close()
    with pytest.raises(ModelError, match="exceeds the model's own limit"):
        build_service(Settings(model_id=str(hub_folder), backend="onnxruntime", num_threads=1,
                               onnx_cache=str(tmp_path), max_input_length=100_000))


def test_model_commit_from_the_hub_cache_local_dir_and_git(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--BAAI--bge-m3" / "snapshots" / sha
    snap.mkdir(parents=True)
    assert model_commit(snap) == sha
    local = tmp_path / "local"
    (local / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (local / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text(f"{sha}\netag\n1.0\n")
    assert model_commit(local) == sha
    clone = tmp_path / "clone"
    (clone / ".git" / "refs" / "heads").mkdir(parents=True)
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (clone / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    assert model_commit(clone) == sha
    assert model_commit(tmp_path) is None


def test_a_pinned_revision_that_is_not_the_folders_commit_is_refused(tmp_path):
    folder = build_m3_folder(tmp_path / "m", hidden=64, layers=1)
    (folder / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("a" * 40 + "\n")
    assert load_model_info(folder, revision="a" * 40).commit == "a" * 40
    with pytest.raises(ModelError, match="pins"):
        load_model_info(folder, revision="b" * 40)


def test_any_loading_failure_ends_the_process_with_the_reason(tmp_path):
    """Not only a ModelError: a loading failure of any kind (here a corrupt graph file) ends the server
    with a non-zero status and writes the reason where Kubernetes reads a termination message."""
    folder = build_m3_folder(tmp_path / "m", hidden=64, layers=1)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"not a protobuf")
    term = tmp_path / "termination-log"
    r = subprocess.run(
        [sys.executable, "-m", "embedops_server.cli", "--model-id", str(folder), "--port", str(free_port()),
         "--hostname", "127.0.0.1", "--backend", "onnxruntime", "--num-threads", "1",
         "--onnx-cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "server"), "EMBEDOPS_TERMINATION_LOG": str(term)})
    assert r.returncode == 1, r.stderr[-2000:]
    assert term.read_text().startswith("model loading failed: ")


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_int8_from_external_data_that_is_linked(hub_folder, tmp_path, link):
    """Model files arrive linked: the Hugging Face cache's snapshot files are symbolic links into its blobs, and
    a copy made with `cp -al` (or a hard-linked PVC) has several links per file. onnx's own external-data loader
    refuses both (its guard against link attacks); the quantizer reads the folder's files as they are."""
    blobs, folder = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    for src in hub_folder.rglob("*"):
        if src.is_dir():
            continue
        dst = folder / src.relative_to(hub_folder)
        dst.parent.mkdir(parents=True, exist_ok=True)
        blob = blobs / src.relative_to(hub_folder).as_posix().replace("/", "--")
        blob.write_bytes(src.read_bytes())
        if link == "symlink":
            dst.symlink_to(blob)
        else:
            os.link(blob, dst)
    data = folder / "onnx" / "model.onnx_data"
    assert data.is_symlink() if link == "symlink" else data.stat().st_nlink == 2
    r = _prepare(folder, tmp_path / "cache", "--quantize", "int8", "--int8-min-cosine", "0.9")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(next((tmp_path / "cache").glob("*/prepared.json")).read_text())
    assert summary["dtype"] == "int8" and summary["int8_cosine"] >= 0.9


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    t = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret"), ("offset", "0"), ("length", "4")):
        t.external_data.add(key=k, value=v)
    model = helper.make_model(helper.make_graph([], "g", [], [], initializer=[t]))
    with pytest.raises(ModelError, match="leaves the model folder"):
        onnx_export.read_external_data(model, tmp_path)
    assert isinstance(model, onnx.ModelProto)


def test_quantizing_keeps_its_temporary_copies_in_the_cache(hub_folder, tmp_path, monkeypatch):
    """The pod's /tmp is an emptyDir of 2Gi; ONNX Runtime's quantizer saves whole copies of the model into
    temporary folders, and bge-m3's float32 copy (2.3 GB) there got the prepare step evicted. They go to the
    cache entry (the cache volume, sized for them) and are gone afterwards."""
    import tempfile

    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **kw: made.append(real_mkdtemp(*a, **kw)) or made[-1])
    out = tmp_path / "entry"
    out.mkdir()
    int8 = onnx_export.quantize_int8(hub_folder / "onnx" / "model.onnx", out)
    assert int8.exists() and made, "the quantizer made no temporary folder: nothing to check"
    assert all(Path(d).parent == out for d in made), made
    assert not any(Path(d).exists() for d in made)
    assert tempfile.tempdir is None or not str(tempfile.tempdir).startswith(str(out))  # restored


def test_two_servers_starting_together_on_one_cache_both_get_every_graph(hub_folder, tmp_path):
    """Two processes making the same cache entry at once (two servers on one machine, two pods on a shared
    volume) used to write the same temporary files: one of them lost its fused graph ("graph fusion failed",
    found with two bench servers started together). The entry's lock makes the second wait and find them."""
    import threading

    import tokenizers

    from embedops_server.service import make_backend
    from embedops_server.settings import Settings

    info = load_model_info(hub_folder)
    settings = Settings(model_id=str(hub_folder), backend="onnxruntime", num_threads=2, quantize="int8",
                        int8_min_cosine=0.9, onnx_cache=str(tmp_path / "cache"))
    made: list = []

    def start():
        tok = tokenizers.Tokenizer.from_file(str(hub_folder / "tokenizer.json"))
        made.append(make_backend(settings, info, tok))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(made) == 2
    assert [b.latency_graph for b in made] == ["fused-int8", "fused-int8"]
    entry = onnx_export.cache_dir(info, settings.onnx_cache)
    assert not [p.name for p in entry.iterdir() if "tmp" in p.name]


def _hub_snapshot(root: Path, sha: str, hidden: int = 64) -> Path:
    """A model downloaded into a Hugging Face cache's layout (snapshots/<commit>), as each pod's download step makes
    it: same path and commit in every pod, new mtimes in each."""
    return build_m3_folder(root / "models--acme--m3" / "snapshots" / sha, hidden=hidden, layers=1)


def test_the_cache_key_is_the_commit_and_the_files_not_the_time_they_were_downloaded(tmp_path):
    """Issue 52: the key held each file's mtime, so each pod's download made an entry of its own on a shared cache."""
    folder = _hub_snapshot(tmp_path, "a" * 40)
    key = onnx_export.cache_key(load_model_info(folder))
    for f in folder.rglob("*"):
        if f.is_file():
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # another pod's download
    assert onnx_export.cache_key(load_model_info(folder)) == key
    # a folder that records no commit is its files' sizes and times (the same for every pod mounting it)
    plain = build_m3_folder(tmp_path / "plain", hidden=64, layers=1)
    before = onnx_export.cache_key(load_model_info(plain))
    cfg = plain / "config.json"
    os.utime(cfg, ns=(cfg.stat().st_atime_ns, cfg.stat().st_mtime_ns + 10**9))
    assert onnx_export.cache_key(load_model_info(plain)) != before


def test_a_shared_cache_keeps_an_entry_another_process_holds_or_used_lately(tmp_path):
    """Issue 52: each new entry removed the other entries of the same folder as 'earlier revisions', so a pod of the
    previous space (or an older replica) whose server container restarted found its graph gone on the read-only
    mount and crash-looped. Now another revision's entry goes only when no process holds it and no start used it
    for STALE_AFTER_SECONDS."""
    cache = tmp_path / "cache"
    old = _hub_snapshot(tmp_path / "hub", "a" * 40)
    old_entry = onnx_export.cache_dir(load_model_info(old), str(cache))
    onnx_export._held.pop(old_entry).close()  # as the pod of that revision did: its lock is another process's
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); fcntl.flock(f, fcntl.LOCK_SH); print('held', "
        "flush=True); time.sleep(60)"), str(old_entry / onnx_export.SOURCE_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        week = onnx_export.STALE_AFTER_SECONDS + 60
        os.utime(old_entry / onnx_export.USED_FILE, (os.path.getmtime(old_entry) - week,) * 2)
        # the new revision prepared into the same cache (its files replaced the old ones in place: same path)
        new = _hub_snapshot(tmp_path / "hub", "a" * 40, hidden=32)
        new_entry = onnx_export.cache_dir(load_model_info(new), str(cache))
        assert new_entry != old_entry and old_entry.is_dir()  # held: kept, though unused for a week
    finally:
        holder.kill()
        holder.wait()
    # not held, used within the week: kept
    os.utime(old_entry / onnx_export.USED_FILE)
    assert onnx_export.prune_stale(cache, keep=new_entry) == [] and old_entry.is_dir()
    # not held, unused for a week: removed
    past = onnx_export.STALE_AFTER_SECONDS + 60
    assert onnx_export.prune_stale(cache, keep=new_entry,
                                   now=os.path.getmtime(old_entry / onnx_export.USED_FILE) + past) == [old_entry]
    assert not old_entry.exists() and new_entry.is_dir()


def test_a_pinned_revision_loads_that_commit_whatever_the_branch_says_now(tmp_path, monkeypatch):
    """Issue 52: every replica of a space loads the commit its first replica resolved. The operator passes it as
    PINNED_REVISION (from a ConfigMap); the branch in --revision (main) has moved on in the cache meanwhile."""
    from embedops_server.settings import Settings

    hub = tmp_path / "hub"
    first, later = "a" * 40, "b" * 40
    for sha, hidden in ((first, 64), (later, 32)):
        build_m3_folder(hub / "models--acme--m3" / "snapshots" / sha, hidden=hidden, layers=1)
    (hub / "models--acme--m3" / "refs").mkdir()
    (hub / "models--acme--m3" / "refs" / "main").write_text(later)
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s = Settings(model_id="acme/m3", pinned_revision=first)
    assert s.revision == "main" and s.model_revision == first
    assert load_model_info(s.model_id, None, s.model_revision).commit == first
    assert load_model_info("acme/m3", None, Settings(model_id="acme/m3").model_revision).commit == later
    with pytest.raises(Exception, match="pinned_revision"):
        Settings(model_id="acme/m3", pinned_revision="main")  # a commit, nothing else
