"""Token-budget batch queue with length-aware grouping.

Cost of a padded batch = longest length x count (what a padded backend actually computes). The oldest entry
always goes into the next batch, so grouping by length can never starve a long (or short) input; its batch
mates are the queued entries closest to it in length, added while the padding stays cheap.

Urgent entries (the interactive lane's, when one engine serves both lanes: core/lanes.py) head the next batch
before older ones; after URGENT_RUN batches headed by urgent entries in a row while other work waited, the
oldest other entry heads one, so the batch lane keeps at least 1 forward in URGENT_RUN + 1.
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
URGENT_RUN = 4


class Entry:
    __slots__ = ("request", "index", "ids", "type_ids", "length", "seq", "taken", "urgent")

    def __init__(self, request: Any, index: int, ids: list[int], type_ids: list[int], urgent: bool = False):
        self.request = request
        self.urgent = urgent
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
        self._urgent: deque[Entry] = deque()  # the urgent ones among them, in arrival order (the same laziness)
        self._urgent_run = 0  # batches headed by an urgent entry in a row while other entries waited
        self._urgent_waiting = 0  # urgent entries queued and not taken
        self._by_len: list[tuple[int, int, Entry]] = []  # sorted by (length, seq)
        self._count = itertools.count()
        self.cv = threading.Condition()

    def __len__(self) -> int:
        return len(self._by_len)

    @property
    def urgent_waiting(self) -> int:
        """Urgent entries queued and not yet taken (read without the lock: for metrics)."""
        return self._urgent_waiting

    def put_many(self, entries: list[Entry], wake: Callable[[], bool] | None = None) -> None:
        """Queue `entries`; wake the threads waiting on `cv` unless `wake` (called under `cv`) says none of
        them can act on the new entries (each wake-up is a thread switch and a turn of the GIL)."""
        with self.cv:
            for e in entries:
                e.seq = next(self._count)
                self._fifo.append(e)
                if e.urgent:
                    self._urgent.append(e)
                    self._urgent_waiting += 1
                bisect.insort(self._by_len, (e.length, e.seq, e))
            if wake is None or wake():
                self.cv.notify_all()

    def form(self) -> tuple[list[Entry], list[Entry]]:
        """Form the next batch now; the caller holds `cv`."""
        dropped = self._purge_cancelled()
        if not self._by_len:
            return [], dropped
        head = self._head()
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
            self._take(e)
        batch.sort(key=lambda e: e.seq)
        return batch, dropped

    def _head(self) -> Entry:
        """The entry the next batch is formed around; the caller holds `cv` and the queue is not empty."""
        while self._fifo[0].taken:
            self._fifo.popleft()
        while self._urgent and self._urgent[0].taken:
            self._urgent.popleft()
        oldest = self._fifo[0]
        others = len(self._by_len) - self._urgent_waiting  # entries of the other lane waiting
        if not self._urgent or not others:
            self._urgent_run = 0
            return oldest
        if self._urgent_run < URGENT_RUN:
            self._urgent_run += 1
            return self._urgent[0]
        self._urgent_run = 0  # the other lane's turn: its oldest entry
        return oldest if not oldest.urgent else next(e for e in self._fifo if not e.taken and not e.urgent)

    def _take(self, e: Entry) -> None:
        e.taken = True
        if e.urgent:
            self._urgent_waiting -= 1

    def top_up(self, batch: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """Entries that arrived after `batch` was formed and still fit it (oldest first); caller holds `cv`.

        The look-ahead batch is formed as soon as a forward starts; inputs arriving during that forward
        would otherwise wait one more forward. Used when the inference thread picks the batch up.
        Returns (extra, dropped) like form()."""
        dropped = self._purge_cancelled()
        max_len = max(e.length for e in batch)
        real, n = sum(e.length for e in batch), len(batch)
        extra: list[Entry] = []
        for e in itertools.chain(self._urgent, self._fifo):
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
            self._take(e)  # (an urgent entry is met twice: in _urgent and in _fifo)
            max_len, real, n = new_max, real + e.length, n + 1
        for e in extra:
            del self._by_len[bisect.bisect_left(self._by_len, (e.length, e.seq))]
        return extra, dropped

    def _purge_cancelled(self) -> list[Entry]:
        if not any(t[2].request.cancelled for t in self._by_len):
            return []
        dropped = [t[2] for t in self._by_len if t[2].request.cancelled]
        self._by_len = [t for t in self._by_len if not t[2].request.cancelled]
        for e in dropped:
            self._take(e)
        return dropped
