"""Read a Hugging Face / sentence-transformers model folder and decide what the model is for."""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

EMBEDDER, SPARSE, RERANKER, CLASSIFIER = "embedding", "sparse", "reranker", "classifier"
POOLINGS = ("cls", "mean", "splade", "last-token")

# bge-m3's extra heads (FlagEmbedding's layout): a linear layer per output next to the transformer's weights.
# "sparse": hidden -> 1, ReLU, max per token id (lexical weights); "colbert": hidden -> d over the token states
# after the first (multi-vector). An embedder without them has only the "dense" output.
DENSE, LEXICAL, COLBERT = "dense", "sparse", "colbert"
HEAD_FILES = {LEXICAL: "sparse_linear.pt", COLBERT: "colbert_linear.pt"}
OUTPUTS = (DENSE, LEXICAL, COLBERT)


class ModelError(RuntimeError):
    """The model folder cannot be served (missing files, unsupported combination)."""


def torch_installed() -> bool:
    """Whether torch can be imported, without importing it (the ONNX Runtime-only image has none)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


NO_TORCH = "torch is not installed in this image"


def no_onnx_without_torch(path: Path) -> ModelError:
    return ModelError(f"{path} has no ONNX file and {NO_TORCH}: ship onnx/model.onnx in the model folder "
                      "or use an image with torch")


@dataclass
class ModelInfo:
    path: Path
    task: str
    pooling: str | None
    normalize: bool
    max_input_length: int
    config: dict = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    id2label: dict[int, str] = field(default_factory=dict)
    onnx_path: Path | None = None
    has_torch_weights: bool = False
    # sentence-transformers Dense modules applied after pooling, in order (folders like 2_Dense)
    dense: tuple[Path, ...] = ()
    # bge-m3 heads found in the folder: output name -> weight file (see HEAD_FILES)
    heads: dict[str, Path] = field(default_factory=dict)
    commit: str | None = None  # the hub commit of the files served, when the folder records it (model_commit)

    @property
    def outputs(self) -> list[str]:
        """The multi-output routes' outputs this model can give (embedders only; [] for other tasks)."""
        if self.task != EMBEDDER:
            return []
        return [DENSE] + [o for o in (LEXICAL, COLBERT) if o in self.heads]

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else self.config.get("model_type", "unknown")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _st_modules(path: Path) -> list[dict]:
    """sentence-transformers' modules.json (the pipeline after the transformer), [] when absent."""
    modules = _read_json(path / "modules.json") if (path / "modules.json").exists() else []
    return modules if isinstance(modules, list) else []


def _st_normalize(modules: list[dict]) -> bool:
    return any(m.get("type", "").endswith("Normalize") for m in modules)


def _st_pooling(path: Path, modules: list[dict]) -> tuple[str | None, bool]:
    """Pooling mode and normalization from sentence-transformers' modules.json / Pooling config."""
    normalize = _st_normalize(modules)
    pool_dir = None
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            pool_dir = path / m.get("path", "1_Pooling")
    cfg = _read_json((pool_dir or path / "1_Pooling") / "config.json")
    if not cfg:
        return None, normalize
    # sentence-transformers >= 6 writes {"pooling_mode": "mean" | [...]}; older versions one flag per mode.
    mode = cfg.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [k[len("pooling_mode_"):].removesuffix("_token").removesuffix("_tokens")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if cfg.get("include_prompt") is False:
        log.warning("the pooling config excludes prompt tokens (include_prompt=false); this server pools them, "
                    "so vectors of prompted inputs differ slightly from sentence-transformers'")
    known = {"cls": "cls", "mean": "mean", "lasttoken": "last-token"}
    if len(modes) == 1 and modes[0] in known:
        return known[modes[0]], normalize
    raise ModelError(f"unsupported sentence-transformers pooling {modes or cfg} in {pool_dir or path / '1_Pooling'}: "
                     "the server implements one of cls, mean, lasttoken (pass --pooling to override)")


# sentence-transformers modules the server implements; any other one would change the vectors silently.
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")


def _st_dense(path: Path, modules: list[dict]) -> tuple[Path, ...]:
    """Dense projections after pooling (modules.json order); refuses modules the server cannot reproduce."""
    dense = []
    for m in modules:
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ModelError(f"unsupported sentence-transformers module {m.get('type')!r} in {path / 'modules.json'}: "
                             f"the server implements {', '.join(_ST_MODULES)}; its vectors would differ")
        if kind == "Dense":
            dense.append(path / m.get("path", f"{m.get('idx', 2)}_Dense"))
    return tuple(dense)


def find_onnx(path: Path) -> Path | None:
    for cand in (path / "onnx" / "model.onnx", path / "model.onnx"):
        if cand.exists():
            return cand
    return None


def resolve_model_path(model_id: str, revision: str | None = None, cache_dir: str | None = None,
                       token: str | None = None) -> Path:
    """A local folder as is; a hub id from the Hugging Face cache (the operator's download init container
    fills $HF_HOME), downloading only when the hub is not marked offline. ``cache_dir``: --huggingface-hub-cache
    (else the variables huggingface_hub reads); ``token``: --hf-token (else its own HF_TOKEN / token file)."""
    path = Path(model_id)
    if path.is_dir():
        return path
    if "/" not in model_id or model_id.startswith(("/", ".")):
        raise ModelError(f"model {model_id} is not a local folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelError(f"model {model_id} is not a local folder and huggingface_hub is missing") from e
    rev = None if revision in (None, "", "main") else revision
    # Read at call time (huggingface_hub freezes its constants at import).
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    cache = (cache_dir or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.environ.get("HF_HUB_CACHE")
             or str(Path(home) / "hub"))
    try:
        return Path(snapshot_download(model_id, revision=rev, local_files_only=True, cache_dir=cache))
    except Exception as cached_error:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            raise ModelError(f"model {model_id} is not in the Hugging Face cache: {cached_error}") from None
    try:
        return Path(snapshot_download(model_id, revision=rev, cache_dir=cache, token=token or None))
    except Exception as e:
        raise ModelError(f"model {model_id} could not be found locally or downloaded: {e}") from None


_SHA = re.compile(r"^[0-9a-f]{40}$")


def model_commit(path: Path) -> str | None:
    """The hub commit a model folder holds, from what the tools that fetch models leave behind: the Hugging
    Face cache's ``snapshots/<commit>`` folder, ``hf download --local-dir``'s ``.cache/huggingface/download/
    *.metadata`` (first line: the commit), or a git clone's HEAD. None when the folder records none."""
    real = path.resolve()
    if real.parent.name == "snapshots" and _SHA.match(real.name):
        return real.name
    meta = real / ".cache" / "huggingface" / "download"
    for f in sorted(meta.rglob("*.metadata")) if meta.is_dir() else []:
        try:
            first = f.read_text().split("\n", 1)[0].strip()
        except OSError:
            continue
        if _SHA.match(first):
            return first
    head = real / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
    except OSError:
        return None
    if ref.startswith("ref: "):
        try:
            ref = (real / ".git" / ref[5:]).read_text().strip()
        except OSError:
            return None
    return ref if _SHA.match(ref) else None


def load_model_info(path: str | Path, pooling: str | None = None, revision: str | None = None,
                    dense_path: str | None = None, hub_cache: str | None = None,
                    token: str | None = None) -> ModelInfo:
    """``dense_path``: TEI's --dense-path, the sentence-transformers Dense module folder (relative to the model's)
    used instead of the ones modules.json names (a model that ships several, e.g. `2_Dense_256` and
    `2_Dense_1024`: one per output size)."""
    path = resolve_model_path(str(path), revision, hub_cache, token)
    if not path.is_dir():
        raise ModelError(f"model {path} is not a local folder")
    if not (path / "tokenizer.json").exists():
        raise ModelError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    config = _read_json(path / "config.json")
    onnx_path = find_onnx(path)
    has_torch = any((path / n).exists() for n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if not config and onnx_path is None:
        raise ModelError(f"{path} has neither config.json nor an ONNX model")
    if pooling is not None and pooling not in POOLINGS:
        raise ModelError(f"unknown pooling {pooling!r}; expected one of {POOLINGS}")

    arch = (config.get("architectures") or [""])[0]
    id2label: dict[int, str] = {}
    dense: tuple[Path, ...] = ()
    modules = _st_modules(path)
    pool_error: ModelError | None = None
    try:
        st_pool, normalize = _st_pooling(path, modules)
    except ModelError as e:  # matters only for an embedder without --pooling
        st_pool, normalize, pool_error = None, _st_normalize(modules), e
    if arch.endswith("ForSequenceClassification"):
        id2label = {int(k): v for k, v in (config.get("id2label") or {0: "LABEL_0"}).items()}
        n = config.get("num_labels") or len(id2label)
        if len(id2label) != n:
            id2label = {i: f"LABEL_{i}" for i in range(n)}
        task = RERANKER if n == 1 else CLASSIFIER
        if pooling:
            log.warning("--pooling is ignored for classifiers")
        pool = None
    elif arch.endswith("ForMaskedLM") and pooling in (None, "splade"):
        task, pool = SPARSE, "splade"
    else:
        if pooling == "splade":
            raise ModelError("splade pooling needs a *ForMaskedLM architecture")
        task = EMBEDDER
        dense = _st_dense(path, modules)
        if dense_path:
            chosen = (path / dense_path).resolve()
            try:
                cfg = json.loads((chosen / "config.json").read_text())
            except (OSError, ValueError):
                cfg = {}
            if not chosen.is_relative_to(path.resolve()) or not isinstance(cfg, dict) or "out_features" not in cfg:
                raise ModelError(f"--dense-path {dense_path}: no Dense module (a config.json with out_features) "
                                 f"in the model's folder at {path / dense_path}")
            dense = (path / dense_path,)
        if pool_error is not None and pooling is None:
            raise pool_error
        pool = pooling or st_pool
        if pool is None:
            # Same fallback as TEI: BERT-family models without a pooling config use CLS.
            if config.get("model_type", "bert") in ("bert", "roberta", "xlm-roberta", "distilbert", "camembert", "mpnet", "modernbert") or not config:
                log.warning("no pooling config found; falling back to CLS pooling")
                pool = "cls"
            else:
                raise ModelError("no pooling config found; pass --pooling")

    st_cfg = _read_json(path / "config_sentence_transformers.json")
    prompts = {k: v for k, v in (st_cfg.get("prompts") or {}).items() if isinstance(v, str)}
    max_len = _max_input_length(path, config)
    heads = {o: path / f for o, f in HEAD_FILES.items() if (path / f).is_file()} if task == EMBEDDER else {}
    if heads and dense:
        raise ModelError(f"{path}: bge-m3 heads ({', '.join(f.name for f in heads.values())}) together with "
                         "sentence-transformers Dense modules are not supported")
    commit = model_commit(path)
    if revision and _SHA.match(revision) and commit and commit != revision:
        # a pinned commit is a promise to the user: serving another one silently would break it
        raise ModelError(f"{path} holds commit {commit}, but --revision pins {revision}")
    return ModelInfo(
        path=path, task=task, pooling=pool, normalize=normalize, max_input_length=max_len,
        config=config, prompts=prompts, default_prompt_name=st_cfg.get("default_prompt_name"),
        id2label=id2label, onnx_path=onnx_path, has_torch_weights=has_torch, dense=dense, heads=heads,
        commit=commit,
    )


# FlagEmbedding drops these special tokens from bge-m3's lexical weights (its tokenizer's special_tokens_map).
_UNUSED_SPECIALS = ("cls_token", "eos_token", "pad_token", "unk_token")


def unused_token_ids(info: ModelInfo, tokenizer) -> list[int]:
    """Token ids that never get a lexical weight: the tokenizer's cls, eos, pad and unk tokens, as named in
    special_tokens_map.json (else tokenizer_config.json), else the config's bos/eos/pad ids."""
    names: dict = {}
    for f in ("special_tokens_map.json", "tokenizer_config.json"):
        names = {k: v for k, v in _read_json(info.path / f).items() if k in _UNUSED_SPECIALS and v}
        if names:
            break
    ids = set()
    for v in names.values():
        tok = v.get("content") if isinstance(v, dict) else v
        tid = tokenizer.token_to_id(tok) if isinstance(tok, str) else None
        if tid is not None:
            ids.add(int(tid))
    if not names:
        ids = {int(info.config[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if info.config.get(k) is not None}
    return sorted(ids)


def _max_input_length(path: Path, config: dict) -> int:
    for name in ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_xlm-roberta_config.json"):
        msl = _read_json(path / name).get("max_seq_length")
        if msl:
            return int(msl)
    mpe = config.get("max_position_embeddings")
    if mpe:
        # RoBERTa-style models reserve pad_token_id + 1 positions.
        if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
            mpe -= int(config.get("pad_token_id", 1)) + 1
        elif config.get("model_type") == "mpnet":  # transformers hard-codes MPNet's padding_idx to 1
            mpe -= 2
        return int(mpe)
    tok = _read_json(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok, int) and tok < 1_000_000:
        return tok
    return 512
