"""The ONNX file the CPU backend runs (the folder's own, or an export of the torch weights) and the opt-in int8
quantization."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..core.model_info import (CLASSIFIER, RERANKER, SPARSE, ModelError, ModelInfo, model_commit,
                               no_onnx_without_torch, torch_installed)
from ..settings import Tuning

log = logging.getLogger(__name__)


# Files whose change must invalidate an export: weights, configs, tokenizer files.
_FINGERPRINTED = (".json", ".safetensors", ".bin", ".pt", ".pth", ".txt", ".model")


def cache_key(info: ModelInfo) -> str:
    """The model folder's path, the commit it records, and each weight/config file's name and size; the files'
    mtimes only for a folder that records no commit.

    The path alone is not enough: a new revision copied to the same volume path (a re-synced PVC, an updated
    image layer) would otherwise be served from the stale export. Hashing the contents would cost seconds per
    start for multi-GB models. A folder that records its commit (a Hugging Face cache, `hf download`, a git clone)
    is that commit: every pod that downloads it gets the same key, though each download has its own mtimes (keyed
    by mtimes, each pod of a shared cache made an entry of its own and removed the others'). A folder without one
    is keyed by size + mtime, what build tools use: the same files for every pod mounting that volume.
    """
    root = info.path.resolve()
    files = [f for f in root.rglob("*") if f.is_file() and f.suffix in _FINGERPRINTED]
    if info.onnx_path is not None:  # the folder's own ONNX file is what int8 quantizes
        files.append(Path(info.onnx_path).resolve())
    commit = model_commit(root)
    h = hashlib.sha256(str(root).encode())
    if commit:
        h.update(f"\0commit {commit}".encode())
    for f in sorted(set(files)):
        st = f.stat()
        h.update(f"\0{f}\0{st.st_size}".encode() + (b"" if commit else f"\0{st.st_mtime_ns}".encode()))
    return h.hexdigest()[:16]


SOURCE_FILE = "source.txt"  # the model folder an entry was made from
USED_FILE = "used"  # touched by every start that can write the cache (each pod's prepare step): its last use
# Another entry (another revision, another model) is removed only once no process holds it (below) and no start has
# used it for this long: a pod of that revision may still run (the previous space of a migration, an older replica),
# and its server container, restarting, finds its entry on the read-only mount only if it is still there.
STALE_AFTER_SECONDS = 7 * 86400
_held: dict[Path, object] = {}  # entry -> the open file whose shared lock this process holds for its life


def cache_root(base: str | None) -> Path:
    return Path(base or Tuning().cache or Path.home() / ".cache" / "embedops")


def cache_dir(info: ModelInfo, base: str | None) -> Path:
    """This model revision's entry in the ONNX cache (``--onnx-cache`` or $ONNX_CACHE, else $EMBEDOPS_CACHE or
    ~/.cache/embedops), held by this process (a shared lock) for its life. Other entries are removed once stale:
    held by no process and unused for `STALE_AFTER_SECONDS` (a long-lived cache volume would otherwise grow with
    every model update; removing another revision's entry at once, as before, deleted the graphs of pods that still
    served it, on a cache many pods share).

    A read-only cache (the serving pods mount the volume the prepare step wrote, read-only) is used as it is:
    its entry must exist, nothing is written or removed."""
    root = cache_root(base)
    d = root / cache_key(info)
    source = str(info.path.resolve())
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not (d / SOURCE_FILE).exists() or (d / SOURCE_FILE).read_text() != source:
            (d / SOURCE_FILE).write_text(source)
        (d / USED_FILE).touch()
    except OSError as e:
        if d.is_dir():
            _hold(d)
            return d  # read-only and prepared: use what is there
        raise ModelError(f"the ONNX cache {root} cannot be written ({e.strerror}) and holds no entry for "
                         f"{source} at this revision: run `embedops-server prepare` with the same flags into it "
                         "first (the operator's prepare step does)") from None
    _hold(d)
    prune_stale(root, keep=d)
    return d


def _hold(entry: Path) -> None:
    """A shared lock on the entry for this process's life: what tells `prune_stale` (in another pod on the same
    volume, local or NFS, where flock is a POSIX lock) that a running server uses it."""
    if entry in _held:
        return
    try:
        f = open(entry / SOURCE_FILE, "rb")
        fcntl.flock(f, fcntl.LOCK_SH)
    except OSError:
        return  # an entry without its source file, or a file system without locks: the age alone protects it
    _held[entry] = f


def release(entry: Path | None = None) -> None:
    """Drop this process's hold on `entry` (None: on every entry): for a process that stops serving a model before
    it exits (tests that load several models, a read-only mount to be unmounted)."""
    for e in [entry] if entry is not None else list(_held):
        f = _held.pop(e, None)
        if f is not None:
            f.close()


def held_elsewhere(entry: Path) -> bool:
    """Whether a process holds `entry` (its shared lock): an exclusive lock cannot be had at once."""
    if entry in _held:
        return True
    try:
        with open(entry / SOURCE_FILE, "r+b") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def prune_stale(root: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the entries other than `keep` that no process holds and no start used for `STALE_AFTER_SECONDS`.
    Returns what was removed."""
    now = time.time() if now is None else now
    removed = []
    for other in root.glob(f"*/{SOURCE_FILE}"):
        entry = other.parent
        try:
            if entry == keep:
                continue
            source = other.read_text()
            used = (entry / USED_FILE).stat().st_mtime if (entry / USED_FILE).exists() else other.stat().st_mtime
        except OSError:
            continue
        if now - used < STALE_AFTER_SECONDS or held_elsewhere(entry):
            continue
        log.info("removing the ONNX cache entry of another revision of %s, unused for %.0f days: %s", source,
                 (now - used) / 86400, entry)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def entry_lock(info: ModelInfo, base: str | None):
    """Hold this model revision's cache entry while its files are made and loaded: two processes starting
    together on one cache (two pods' prepare steps on a shared volume, two servers on one machine) would
    otherwise write the same temporary files at once, and one of them fail or keep a half-written graph. The
    second waits, then finds every file made. A read-only cache is used as it is, without the lock; one that
    can be neither written nor read is the backend's to report, if it needs the cache at all (a float32 ONNX
    folder served without the one-query session does not)."""
    try:
        entry = cache_dir(info, base)
        lock = open(entry.parent / f".{entry.name}.lock", "w")
    except (ModelError, OSError):  # read-only (nothing is made here), or the backend's to report
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def export_onnx(info: ModelInfo, out_dir: Path) -> Path:
    """Export the head the server needs: hidden states (embedders), pooled SPLADE vector or logits."""
    # Eager attention, not SDPA: ONNX Runtime runs the exported SDPA graph 2.2x slower on long inputs (all-MiniLM-L6-v2,
    # 2 Xeon cores, 32 x 256 tokens: 2442 ms vs 1119; 1 x 16 tokens unchanged). ORT's own graph optimizations
    # fuse the eager pattern; its offline BERT fusions (Attention, SkipLayerNorm) were 5-15% slower still on top
    # on batches (one-query forwards gain from them: fuse_for_latency).
    # The name changed with it, so SDPA exports cached before are not reused.
    target = out_dir / "model.eager.onnx"
    if target.exists():
        return target
    import torch

    from .torch_backend import load_torch_model

    model = load_torch_model(info, "float32", "cpu", attention="eager")
    task = info.task
    uses_tti = int(info.config.get("type_vocab_size", 0) or 0) > 0 and \
        "token_type_ids" in inspect.signature(model.forward).parameters

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            kw = {"input_ids": input_ids, "attention_mask": attention_mask}
            if uses_tti:
                kw["token_type_ids"] = token_type_ids
            out = self.m(**kw)
            if task in (RERANKER, CLASSIFIER):
                return out.logits
            if task == SPARSE:
                act = torch.log1p(torch.relu(out.logits)) * attention_mask[..., None].to(out.logits.dtype)
                return act.amax(1)
            return out.last_hidden_state

    ids = torch.ones((2, 8), dtype=torch.long)
    out_name = "logits" if task in (RERANKER, CLASSIFIER) else ("sparse" if task == SPARSE else "last_hidden_state")
    # Into a folder of its own: a model over protobuf's 2 GB limit (bge-m3: 2.2 GB) is written with every
    # weight in a file of its own beside the graph (~390 files), which is then packed into one data file.
    work = out_dir / "export.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    tmp = work / target.name
    log.info("exporting %s to ONNX at %s", info.path, target)
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
           "token_type_ids": {0: "batch", 1: "seq"}}
    with torch.inference_mode():
        torch.onnx.export(
            Head().eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(tmp),
            input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=[out_name],
            dynamic_axes={**dyn, out_name: {0: "batch"}}, opset_version=17, dynamo=False,
        )
    del model  # the torch weights (a full float32 copy) before the graph is loaded to be packed
    import gc

    gc.collect()
    if len(list(work.iterdir())) > 1:
        _pack_external_data(tmp, out_dir / target.name)
    else:
        os.replace(tmp, target)
    shutil.rmtree(work, ignore_errors=True)
    return target


def external_data_suffix(model: Path) -> Path:
    return model.with_name(model.name + ".data")


def _pack_external_data(src: Path, target: Path) -> None:
    """Save ``src`` (a graph whose weights are many files beside it) as ``target`` with one data file,
    ``<target>.data``: one file to copy, map and checksum instead of hundreds."""
    import onnx

    data = external_data_suffix(target)
    model = onnx.load(str(src))  # with its external data
    tmp = target.with_name(target.name + ".tmp")
    data_tmp = external_data_suffix(tmp)
    onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_tmp.name, size_threshold=1024)
    del model
    # the graph names its data file: rename the file, then rewrite the (small) graph with the final name
    os.replace(data_tmp, data)
    graph = onnx.load(str(tmp), load_external_data=False)
    for t in _external_tensors(graph):
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = data.name
    onnx.save_model(graph, str(tmp))
    os.replace(tmp, target)


def _external_tensors(graph_model) -> list:
    """Tensors whose data lives in an external file: initializers and tensor attributes, subgraphs included."""
    from onnx import AttributeProto, TensorProto

    out = []

    def walk(graph):
        out.extend(graph.initializer)
        for node in graph.node:
            for a in node.attribute:
                if a.type == AttributeProto.TENSOR:
                    out.append(a.t)
                elif a.type == AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        walk(g)

    walk(graph_model.graph)
    return [t for t in out if t.data_location == TensorProto.EXTERNAL]


INLINE_WEIGHTS_BYTES = 64 << 20  # an ONNX file this big holds its weights itself (external-data graphs are small)


def graph_files(path: Path) -> list[Path]:
    """The ONNX file and every external data file it names (the Hub's bge-m3: onnx/model.onnx plus
    model.onnx_data). A large file is not parsed: it holds its weights inline (parsing bge-m3's 0.57 GB int8
    graph just to find none would hold another copy of it in memory at start)."""
    import onnx

    if path.stat().st_size > INLINE_WEIGHTS_BYTES:
        return [path]
    graph = onnx.load(str(path), load_external_data=False)
    files = {path}
    for t in _external_tensors(graph):
        for entry in t.external_data:
            if entry.key == "location":
                files.add(path.parent / entry.value)
    return sorted(files)


def graph_bytes(path: Path) -> int:
    """Bytes of weights a session of this graph holds: the file and its external data. The graph file alone
    of a model with external data is a few hundred KB whatever the model's size."""
    return sum(f.stat().st_size for f in graph_files(path) if f.exists())


def model_file(info: ModelInfo, cache: str | None = None) -> Path:
    """The float32 ONNX file the server runs for ``info``: the folder's own, else an export of its weights."""
    if info.onnx_path is not None:
        return Path(info.onnx_path)
    if not info.has_torch_weights:
        raise ModelError(f"{info.path} has no ONNX model and no torch weights to export from")
    if not torch_installed():
        raise no_onnx_without_torch(info.path)
    return export_onnx(info, cache_dir(info, cache))


def quantize_int8(src: Path, out_dir: Path) -> Path:
    """Dynamic int8 with per-channel weights and reduced range: per-tensor costs MiniLM ~0.05-0.1 cosine."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = out_dir / f"{src.stem}.int8.onnx"
    if not target.exists():
        tmp = out_dir / f"{src.stem}.int8.tmp.onnx"
        # DefaultTensorType: the fused graph's contrib operators (Attention, SkipLayerNormalization) have no
        # shape inference, so the quantizer is told their outputs are float32
        import onnx

        with _quantizer_writes_in(out_dir):
            quantize_dynamic(str(src), str(tmp), per_channel=True, reduce_range=True, weight_type=QuantType.QInt8,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        os.replace(tmp, target)
    return target


@contextlib.contextmanager
def _quantizer_writes_in(work_dir: Path):
    """Everything ONNX Runtime's quantizer writes goes to ``work_dir`` (the cache entry, on the cache volume).

    It writes its input's shape-inferred copy, `<model>-inferred.onnx`, beside the input: on the read-only
    model volume a pod mounts, quantizing the folder's own onnx/model.onnx failed (FileNotFoundError). This
    writes that copy into ``work_dir`` and reads the weights from beside the input."""
    import importlib

    import onnx
    from onnxruntime.quantization import quant_utils

    # the module, not the package's `quantize` function of the same name
    quantize_module = importlib.import_module("onnxruntime.quantization.quantize")

    original = getattr(quantize_module, "load_model_with_shape_infer", None)
    if original is None:  # another ONNX Runtime layout: its own behaviour (works where the folder is writable)
        log.warning("onnxruntime.quantization has no load_model_with_shape_infer: quantizing needs a writable "
                    "model folder")
        yield
        return

    def load_with_shape_infer(model_path: Path):
        model_path = Path(model_path)
        inferred = work_dir / f"{model_path.stem}-inferred.onnx"
        onnx.shape_inference.infer_shapes_path(str(model_path), str(inferred))
        model = onnx.load(str(inferred), load_external_data=False)
        inferred.unlink()
        read_external_data(model, model_path.parent)
        quant_utils.add_infer_metadata(model)
        return model

    quantize_module.load_model_with_shape_infer = load_with_shape_infer
    # The quantizer also saves whole copies of the model (weights as external data) into temporary folders:
    # in a pod that is /tmp, an emptyDir of 2Gi, and bge-m3's 2.3 GB float32 copy got the prepare step evicted
    # ("Usage of EmptyDir volume tmp exceeds the limit"). Its temporaries go to ``work_dir`` too, the cache
    # volume sized for them.
    saved_tempdir = tempfile.tempdir
    tempfile.tempdir = str(work_dir)
    try:
        yield
    finally:
        quantize_module.load_model_with_shape_infer = original
        tempfile.tempdir = saved_tempdir


def read_external_data(model, base: Path) -> None:
    """Load every external tensor's bytes into the model, reading the files the graph names relative to
    ``base``. onnx's own loader refuses a data file that is a symbolic link or has several hard links (its
    guard against link attacks), but that is how model files arrive: the Hugging Face cache's snapshots are
    symbolic links into its blobs, and a copy made with `cp -al` is hard-linked. The files are the operator's
    own model volume, read-only, so they are read as they are."""
    from onnx import TensorProto

    handles: dict[str, object] = {}
    try:
        for t in _external_tensors(model):
            info = {e.key: e.value for e in t.external_data}
            location = info["location"]
            if Path(location).is_absolute() or ".." in Path(location).parts:
                raise ModelError(f"{base}: external data location {location!r} leaves the model folder")
            f = handles.get(location)
            if f is None:
                f = handles[location] = open(base / location, "rb")
            f.seek(int(info.get("offset", 0)))
            length = int(info["length"]) if "length" in info else -1
            t.raw_data = f.read(length)
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
    finally:
        for f in handles.values():
            f.close()


def gate_record(quantized: Path) -> Path:
    return quantized.with_name(quantized.name + ".gate.json")


def read_gate(quantized: Path) -> dict | None:
    """The int8 gate's result measured when ``quantized`` was made (prepare, or a first start), so a later
    start need not load the float32 graph beside it (bge-m3: 2.2 GB more at start) to measure it again."""
    import json

    try:
        record = json.loads(gate_record(quantized).read_text())
    except (OSError, ValueError):
        return None
    st = quantized.stat()
    if record.get("size") != st.st_size or record.get("mtime_ns") != st.st_mtime_ns:
        return None  # made for another file
    return record


def write_gate(quantized: Path, metric: str, value: float) -> None:
    import json

    st = quantized.stat()
    try:
        gate_record(quantized).write_text(json.dumps(
            {"metric": metric, "value": value, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    except OSError as e:  # a read-only cache: the next start measures again
        log.warning("cannot record the int8 gate result next to %s: %s", quantized, e)


# Encoder families whose attention ONNX Runtime's offline BERT optimizer recognises (pattern-matched; the
# result is checked against the plain graph before use).
FUSABLE = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert")
ATTENTION_OPS = ("Attention", "MultiHeadAttention")  # what the optimizer fuses a block's attention into


def fuse_for_latency(src: Path, info: ModelInfo, out_dir: Path) -> Path | None:
    """The graph with ONNX Runtime's offline transformer fusions (one Attention, SkipLayerNormalization,
    BiasGelu and EmbedLayerNormalization node per block: MiniLM-L6 254 -> 46 nodes after ORT's own online
    optimizations). Fewer, larger operators cut the per-operator overhead that dominates a one-query forward;
    on large batches the fused attention was slower (see export_onnx), so only the small-forward session uses
    it. None when the family is not one the optimizer knows or no attention was fused."""
    cfg = info.config
    # 0: the optimizer reads them from the graph (a bare ONNX folder without config.json)
    heads, hidden = int(cfg.get("num_attention_heads") or 0), int(cfg.get("hidden_size") or 0)
    if cfg.get("model_type", "bert") not in FUSABLE:
        return None
    target = out_dir / f"{src.stem}.fused.onnx"
    if target.exists():
        return target
    empty = out_dir / f"{src.stem}.fused.none"  # a previous start found nothing to fuse
    if empty.exists():
        return None
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    # read as read_external_data reads model files (a folder whose data file is hard-linked, as pip's or uv's
    # caches install them, or a symbolic link, as the Hub's cache, is refused by onnx's own loader); small
    # models only (the latency session's), so the weights fit in memory
    graph = onnx.load(str(src), load_external_data=False)
    read_external_data(graph, src.parent)
    opt_logger = logging.getLogger("onnxruntime.transformers")
    level = opt_logger.level
    opt_logger.setLevel(logging.ERROR)  # its per-fusion INFO/WARNING lines are not the operator's business
    try:
        model = optimize_model(graph, model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0)
    finally:
        opt_logger.setLevel(level)
    if not any(n.op_type in ATTENTION_OPS for n in model.model.graph.node):
        try:
            empty.touch()
        except OSError:
            pass  # read-only cache: found again next start
        return None
    tmp = out_dir / f"{src.stem}.fused.tmp.onnx"
    model.save_model_to_file(str(tmp))
    os.replace(tmp, target)
    return target
