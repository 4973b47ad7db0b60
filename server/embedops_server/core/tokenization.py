"""Tokenization workers: OS threads, each with its own Rust tokenizer clone, encoding drained jobs in batches.

The Rust `encode_batch` releases the GIL, so tokenization overlaps with the inference thread. A small job
(a query, a few short texts) is encoded on the submitting thread instead: waking a worker costs more than
encoding it, and on a busy machine far more (the worker waits for a core behind the forwards).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from tokenizers import Tokenizer

from .errors import TOKENIZER, VALIDATION, EngineError

log = logging.getLogger(__name__)

# TEI rejects (or, with truncation, cuts) texts over max_input_length * 250 characters before tokenizing:
# it bounds the work an attacker can ask of the tokenizer.
CHARS_PER_TOKEN_LIMIT = 250
_DRAIN = 64  # jobs merged into one encode_batch call
# Jobs up to this size are encoded on the submitting thread: 50-300 us for a short query (more when the caches
# are cold between requests), against a worker hand-off of 0.4-0.5 ms idle and ~6 ms at c=16 on 2 busy cores.
INLINE_MAX_TEXTS = 4
INLINE_MAX_CHARS = 2048


@dataclass(slots=True)
class EncodeJob:
    texts: Sequence  # str, or (str, str) pairs
    truncate: bool
    direction: str  # "right" | "left"
    max_length: int
    done: Callable  # done(list[(ids, type_ids)] | None, EngineError | None)
    add_special_tokens: bool = True
    delivered: bool = False  # `done` has been called: never call it again (a second result would be a lie)

    @property
    def settings(self) -> tuple:
        """What one encode_batch call must share: jobs with equal settings are encoded together."""
        return self.truncate, self.direction, self.max_length, self.add_special_tokens


class TokenizerPool:
    def __init__(self, tokenizer_path: str, workers: int):
        self.path = tokenizer_path
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # One tokenizer for the submitting thread's small jobs and the synchronous uses (/tokenize, decode, the
        # int8 gate); the lock keeps a second user off its truncation settings. A copy each would cost memory
        # that grows with the vocabulary: ~110 MB per instance for XLM-R's 250k pieces (bge-m3).
        self._base = self._load()
        self._inline = self._base
        self._inline_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"tokenizer-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _load(self) -> Tokenizer:
        tok = Tokenizer.from_file(self.path)
        # tokenizer.json may carry its own truncation/padding (the ONNX MiniLM pads to 128): we do both ourselves.
        tok.no_truncation()
        tok.no_padding()
        return tok

    @property
    def tokenizer(self) -> Tokenizer:
        """For reading the vocabulary and decoding (settings-free); encode through `encode_untruncated`."""
        return self._base

    def encode_untruncated(self, texts: list, add_special_tokens: bool = True) -> list:
        """The synchronous encode (/tokenize): on the shared tokenizer, under its lock, without truncation."""
        with self._inline_lock:
            self._base.no_truncation()
            return self._base.encode_batch(texts, add_special_tokens=add_special_tokens)

    def submit(self, job: EncodeJob) -> None:
        """Encode `job` now on this thread if it is small (its `done` runs here), else on a worker."""
        if _small(job.texts) and self._inline_lock.acquire(blocking=False):
            try:  # tokenizer errors reach `done` as EngineErrors; anything else is the caller's to see
                self._encode_group(self._inline, job.settings, [job])
            finally:
                self._inline_lock.release()
            return
        self._jobs.put(job)

    @property
    def workers(self) -> int:
        return len(self._threads)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        tok = self._load()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < _DRAIN:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                jobs.append(nxt)
            groups: dict[tuple, list[EncodeJob]] = {}
            for j in jobs:
                groups.setdefault(j.settings, []).append(j)
            for key, group in groups.items():
                try:
                    self._encode_group(tok, key, group)
                except Exception as e:  # keep the worker alive; undelivered jobs get an error, not a hang
                    for j in group:
                        if not j.delivered:
                            _deliver(j, None, EngineError(TOKENIZER, f"tokenizer error: {e}"), on_worker=True)

    def _encode_group(self, tok: Tokenizer, key: tuple, group: list[EncodeJob]) -> None:
        """Encode `group` and deliver each job's result. On a worker thread a `done` that raises is logged and
        the other jobs still get theirs; on the submitting thread (inline) its exception is the submitter's."""
        on_worker = threading.current_thread() in self._threads
        truncate, direction, max_length, add_special = key
        char_limit = max_length * CHARS_PER_TOKEN_LIMIT
        flat: list = []
        spans: list[tuple[EncodeJob, int, int]] = []
        for j in group:
            try:
                texts = [_clip(t, char_limit, truncate, direction) for t in j.texts]
            except EngineError as e:
                _deliver(j, None, e, on_worker)
                continue
            spans.append((j, len(flat), len(flat) + len(texts)))
            flat.extend(texts)
        if not flat:
            return
        try:
            if truncate:
                tok.enable_truncation(max_length, strategy="longest_first", direction=direction)
            else:
                tok.no_truncation()
            encs = tok.encode_batch(flat, add_special_tokens=add_special)
        except Exception as e:  # a bad text poisons only its own jobs: retry one by one
            if len(spans) > 1:
                for j, _, _ in spans:
                    self._encode_group(tok, key, [j])
                return
            _deliver(spans[0][0], None, EngineError(TOKENIZER, _describe(flat, e)), on_worker)
            return
        for j, a, b in spans:
            out = []
            err = None
            for k in range(a, b):
                ids = encs[k].ids
                if len(ids) > max_length:
                    err = EngineError(
                        VALIDATION,
                        f"Input validation error: `inputs` must have less than {max_length} tokens. "
                        f"Given: {len(ids)}",
                    )
                    break
                if not ids:
                    err = EngineError(VALIDATION, "Input validation error: an input produced no tokens")
                    break
                out.append((ids, encs[k].type_ids))
            _deliver(j, None if err else out, err, on_worker)


def _deliver(job: EncodeJob, out, err, on_worker: bool) -> None:
    """Call `job.done` once. A worker logs a failing callback (its job's submitter is gone or broken) and goes
    on with the others; inline, the exception reaches the submitter."""
    job.delivered = True
    try:
        job.done(out, err)
    except Exception:
        if not on_worker:
            raise
        log.exception("a tokenization callback failed; the other jobs of its batch are unaffected")


def _small(texts: Sequence) -> bool:
    if len(texts) > INLINE_MAX_TEXTS:
        return False
    chars = 0
    for t in texts:
        chars += len(t) if isinstance(t, str) else sum(len(x) for x in t)
    return chars <= INLINE_MAX_CHARS


def _clip(text, limit: int, truncate: bool, direction: str):
    if isinstance(text, str):
        if len(text) > limit:
            if not truncate:
                raise EngineError(
                    VALIDATION, f"Input validation error: `inputs` must have less than {limit} characters"
                )
            return text[-limit:] if direction == "left" else text[:limit]
        return text
    return tuple(_clip(t, limit, truncate, direction) for t in text)


def _describe(texts: list, exc: Exception) -> str:
    """The tokenizer's own message names its Python signature; say what is wrong with the input instead."""
    for n, item in enumerate(texts):
        for t in (item,) if isinstance(item, str) else item:  # a text, or a (query, passage) pair
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as u:
                return (f"text {n} is not valid Unicode: a lone surrogate ({t[u.start]!r}) at character {u.start}; "
                        "send UTF-8 text")
            except AttributeError:
                pass
    return f"tokenizer error: {exc}"
