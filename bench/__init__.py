"""embedops benchmark suite: ``python -m bench`` (``make bench BENCH_ARGS=...``).

Runs embedops, the raw backend forward (the ceiling), infinity-emb and a naive ``encode()`` app side by
side on the same deterministic traffic, and reports ratios. See docs/bench.md.
"""
