"""Token-budget batch queue with length-aware grouping.

Cost of a padded batch = longest length x count (what a padded backend actually computes). The oldest entry
always goes into the next batch, so grouping by length can never starve a long (or short) input; its batch
mates are the queued entries closest to it in length, added while the padding stays cheap.
"""
from __future__ import annotations

import bisect
import itertools
import threading
from collections import deque
from typing import Any, Callable

# Below this padded size a batch is dominated by fixed per-forward overhead, so padding waste is irrelevant.
SMALL_BATCH_TOKENS = 512
# Otherwise an entry joins only if the batch stays at least this efficient (real / padded tokens).
MIN_EFFICIENCY = 0.8


class Entry:
    __slots__ = ("request", "index", "ids", "type_ids", "length", "seq", "taken")

    def __init__(self, request: Any, index: int, ids: list[int], type_ids: list[int]):
        self.request = request
        self.index = index
        self.ids = ids
        self.type_ids = type_ids
        self.length = len(ids)
        self.seq = 0
        self.taken = False


class BatchQueue:
    """`max_batch_tokens` is the budget ceiling (TEI semantics); `forward_tokens`, when smaller, is the padded
    size one forward pass should not exceed (a CPU backend's efficient size): batches are formed to it, the
    oldest entry always going first even if it alone is longer."""

    def __init__(self, max_batch_tokens: int, max_batch_requests: int | None, forward_tokens: int | None = None):
        self.max_batch_tokens = max_batch_tokens
        self.forward_tokens = min(max_batch_tokens, forward_tokens or max_batch_tokens)
        self.max_batch_requests = max_batch_requests or 1 << 30
        self._fifo: deque[Entry] = deque()  # arrival order (taken entries are removed lazily)
        self._by_len: list[tuple[int, int, Entry]] = []  # sorted by (length, seq)
        self._count = itertools.count()
        self.cv = threading.Condition()

    def __len__(self) -> int:
        return len(self._by_len)

    def put_many(self, entries: list[Entry], wake: Callable[[], bool] | None = None) -> None:
        """Queue `entries`; wake the threads waiting on `cv` unless `wake` (called under `cv`) says none of
        them can act on the new entries (each wake-up is a thread switch and a turn of the GIL)."""
        with self.cv:
            for e in entries:
                e.seq = next(self._count)
                self._fifo.append(e)
                bisect.insort(self._by_len, (e.length, e.seq, e))
            if wake is None or wake():
                self.cv.notify_all()

    def next_batch(self, timeout: float | None = None) -> tuple[list[Entry], list[Entry]]:
        """Block until work is queued; return (batch, dropped) where dropped are cancelled entries skipped."""
        with self.cv:
            if not self._by_len and not self.cv.wait_for(lambda: self._by_len, timeout):
                return [], []
            return self.form()

    def form(self) -> tuple[list[Entry], list[Entry]]:
        """Form the next batch now; the caller holds `cv`."""
        dropped = self._purge_cancelled()
        if not self._by_len:
            return [], dropped
        while self._fifo[0].taken:
            self._fifo.popleft()
        head = self._fifo[0]
        pos = bisect.bisect_left(self._by_len, (head.length, head.seq))
        lo, hi = pos, pos + 1  # window [lo, hi) of the length-sorted list
        max_len, real, n = head.length, head.length, 1
        sl = self._by_len
        budget, cap = self.forward_tokens, self.max_batch_requests
        while n < cap:
            left = sl[lo - 1][0] if lo > 0 else None
            right = sl[hi][0] if hi < len(sl) else None
            # Adding a shorter entry pads it up to max_len; adding a longer one pads everybody up to it.
            waste_l = max_len - left if left is not None else None
            waste_r = (right - max_len) * n if right is not None else None
            if waste_l is None and waste_r is None:
                break
            take_left = waste_r is None or (waste_l is not None and waste_l <= waste_r)
            new_len = left if take_left else right
            new_max = max(max_len, new_len)
            padded = new_max * (n + 1)
            if padded > budget:
                if take_left or waste_l is None or max_len * (n + 1) > budget:
                    break
                take_left, new_len, new_max, padded = True, left, max_len, max_len * (n + 1)
            if padded > SMALL_BATCH_TOKENS and (real + new_len) / padded < MIN_EFFICIENCY:
                break
            if take_left:
                lo -= 1
            else:
                hi += 1
            max_len, real, n = new_max, real + new_len, n + 1
        batch = [t[2] for t in sl[lo:hi]]
        del sl[lo:hi]
        for e in batch:
            e.taken = True
        batch.sort(key=lambda e: e.seq)
        return batch, dropped

    def top_up(self, batch: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """Entries that arrived after `batch` was formed and still fit it (oldest first); caller holds `cv`.

        The look-ahead batch is formed as soon as a forward starts; inputs arriving during that forward
        would otherwise wait one more forward. Used when the inference thread picks the batch up.
        Returns (extra, dropped) like form()."""
        dropped = self._purge_cancelled()
        max_len = max(e.length for e in batch)
        real, n = sum(e.length for e in batch), len(batch)
        extra: list[Entry] = []
        for e in self._fifo:
            if n >= self.max_batch_requests:
                break
            if e.taken:
                continue
            new_max = max(max_len, e.length)
            padded = new_max * (n + 1)
            if padded > self.forward_tokens or (
                    padded > SMALL_BATCH_TOKENS and (real + e.length) / padded < MIN_EFFICIENCY):
                continue  # it heads a later batch instead
            extra.append(e)
            max_len, real, n = new_max, real + e.length, n + 1
        for e in extra:
            e.taken = True
            del self._by_len[bisect.bisect_left(self._by_len, (e.length, e.seq))]
        return extra, dropped

    def _purge_cancelled(self) -> list[Entry]:
        if not any(t[2].request.cancelled for t in self._by_len):
            return []
        dropped = [t[2] for t in self._by_len if t[2].request.cancelled]
        self._by_len = [t for t in self._by_len if not t[2].request.cancelled]
        for e in dropped:
            e.taken = True
        return dropped
