"""An exact-match cache of the engine's answers, for one embedding space (issue 56).

Re-indexing re-embeds every chunk, and real corpora repeat chunks (boilerplate, headers, duplicates); hot queries
repeat. An answer is cached by what decides it: the input as the model reads it (the text after the prompt, or a
rerank's pair), whether it is truncated and from which side. The rest of the key is the process: one server
serves one embedding space (weights, pooling, prompt, quantization, input length: core/space.py), so a model
change, which is a new space and a new process, starts with an empty cache by construction and can never answer
a vector of the old space. Options applied after the engine (`normalize`, `dimensions`) are not part of the key:
the cache holds the engine's raw answer, and each request's options are applied to it as to a computed one.

Bounded by bytes (each entry's array, its key and a fixed overhead), least recently used first out. Answers of
every token's state (/embed_all) and bge-m3's multi-output requests are not cached (their size is the request's).
Touched on the event loop only (lookups before admission, inserts when a request's answers are complete), so it
takes no lock; the counters are read by the metrics at scrape time.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

ENTRY_OVERHEAD = 200  # bytes per entry beyond its array and key: the dict slot, the key tuple, the array header


def _key_bytes(item: Any) -> int:
    if isinstance(item, tuple):
        return sum(sys.getsizeof(x) for x in item)
    return sys.getsizeof(item)


@dataclass
class Lookup:
    """What the cache had for one request: ``results`` (an answer, or None where it must be computed) and the
    keys of the inputs to compute (``missing``: their indices), which `keep` inserts once they are answered."""
    cache: "AnswerCache"
    results: list
    keys: list
    missing: list[int]

    @property
    def hits(self) -> int:
        return len(self.results) - len(self.missing)

    def keep(self) -> None:
        """The computed answers (in ``results`` now) into the cache."""
        for i in self.missing:
            self.cache.put(self.keys[i], self.results[i])


class AnswerCache:
    def __init__(self, max_bytes: int, space: str = ""):
        self.max_bytes = max_bytes
        self.space = space  # the fingerprint it was made for (reported; the key needs no more, see above)
        self._entries: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, items: Sequence, truncate: bool, direction: str) -> Lookup:
        results: list = []
        keys: list = []
        missing: list[int] = []
        for i, item in enumerate(items):
            key = (item if isinstance(item, (str, tuple)) else tuple(item), truncate, direction)
            keys.append(key)
            got = self._entries.get(key)
            if got is None:
                missing.append(i)
            else:
                self._entries.move_to_end(key)
            results.append(got)
        self.hits += len(items) - len(missing)
        self.misses += len(missing)
        return Lookup(self, results, keys, missing)

    def put(self, key: Hashable, value: np.ndarray) -> None:
        """Keep a copy of ``value`` (an engine answer is a row of its batch's array: a view would hold the whole
        batch), read-only, so that no route can change what a later hit returns."""
        if key in self._entries:
            return
        value = np.array(value, copy=True)
        value.setflags(write=False)
        size = value.nbytes + _key_bytes(key[0]) + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return
        self._entries[key] = value
        self._sizes[key] = size
        self.bytes += size
        while self.bytes > self.max_bytes:
            old, _ = self._entries.popitem(last=False)
            self.bytes -= self._sizes.pop(old)
            self.evictions += 1
