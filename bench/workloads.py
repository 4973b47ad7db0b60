"""The five scenarios' traffic, generated deterministically from a seed with exact token counts."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .textgen import TextGen


@dataclass
class Profile:
    name: str
    duration_s: float          # per HTTP run (closed loop), bounded again by max_requests
    max_requests: int
    ceiling_budget_s: float    # per ceiling measurement
    concurrencies: list[int]   # scenario 2 sweep (scenario 1 adds concurrency 1)
    ingest_requests: int       # scenario 3: requests per target
    rerank_requests: int       # scenario 4: requests per target
    mixed_duration_s: float    # scenario 5
    both_tokenization: bool = True  # ceilings with tokenization included AND excluded for 4/5 too
    heavy_ceiling_iters: int = 3    # forwards timed per ceiling of scenarios 3-5 (seconds each on CPU)
    heavy_warmup: int = 1           # unrecorded requests before scenarios 3-4 (servers warm up at startup)


PROFILES = {
    "quick": Profile("quick", duration_s=3.0, max_requests=3000, ceiling_budget_s=1.5, concurrencies=[16, 64],
                     ingest_requests=3, rerank_requests=1, mixed_duration_s=4, both_tokenization=False,
                     heavy_ceiling_iters=1, heavy_warmup=0),
    "full": Profile("full", duration_s=30, max_requests=50_000, ceiling_budget_s=8.0,
                    concurrencies=[4, 16, 32, 64], ingest_requests=24, rerank_requests=10,
                    mixed_duration_s=40),
}


def customize(profile: Profile, concurrencies: list[int] | None = None, duration_s: float | None = None) -> Profile:
    """The profile with scenario 2's sweep and the closed-loop run length overridden (None: keep)."""
    changes = {}
    if concurrencies:
        changes["concurrencies"] = concurrencies
    if duration_s:
        changes.update(duration_s=duration_s, mixed_duration_s=duration_s)
    return replace(profile, **changes) if changes else profile


SHORT_QUERY_TOKENS = 16
SINGLE_TEXT_TOKENS = 32
INGEST_TEXTS, INGEST_TOKENS = 32, 256
RERANK_PASSAGES, RERANK_PASSAGE_TOKENS, RERANK_QUERY_TOKENS = 50, 256, 32
MIXED_RANGE = (16, 512)
MIXED_CLIENTS = 32


@dataclass
class Workloads:
    short_queries: list[str] = field(default_factory=list)
    single_texts: list[str] = field(default_factory=list)
    ingest_batches: list[list[str]] = field(default_factory=list)
    rerank_query: str = ""
    rerank_passages: list[list[str]] = field(default_factory=list)
    mixed_texts: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def build(gen: TextGen, profile: Profile) -> Workloads:
    w = Workloads()
    w.short_queries = gen.texts(64, SHORT_QUERY_TOKENS)
    w.single_texts = gen.texts(1024, SINGLE_TEXT_TOKENS)
    w.ingest_batches = [gen.texts(INGEST_TEXTS, INGEST_TOKENS) for _ in range(max(4, profile.ingest_requests))]
    w.rerank_query = gen.text(RERANK_QUERY_TOKENS)
    w.rerank_passages = [gen.texts(RERANK_PASSAGES, RERANK_PASSAGE_TOKENS) for _ in range(2)]
    w.mixed_texts = gen.texts(2048, MIXED_RANGE)
    w.counts = {
        "short_queries": gen.count(w.short_queries),
        "single_texts": gen.count(w.single_texts),
        "ingest_batches": [sum(gen.count(b)) for b in w.ingest_batches],
        "mixed_texts": gen.count(w.mixed_texts),
        # a pair encodes as [CLS] q [SEP] p [SEP]: q + p - 1 tokens
        "rerank_pair_tokens": RERANK_QUERY_TOKENS + RERANK_PASSAGE_TOKENS - 1,
    }
    assert set(w.counts["short_queries"]) == {SHORT_QUERY_TOKENS}
    assert set(w.counts["single_texts"]) == {SINGLE_TEXT_TOKENS}
    return w
