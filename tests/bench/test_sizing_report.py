"""bench/sizing.py's side-by-side table: which way each ratio points (no timings)."""
from __future__ import annotations

from bench.sizing import throughput_table


def _row(case, serve, tei=None, raw=None):
    return {"case": case, "serve": serve, "tei": tei or {}, "raw": raw or {}}


def test_ingestion_ratios_are_ours_over_theirs_and_hybrid_over_dense():
    out = throughput_table([_row("m3-int8", {"ingest_tokens_per_s": 1200.0, "hybrid_tokens_per_s": 1140.0},
                                 {"ingest_tokens_per_s": 1000.0}, {"ingest_tokens_per_s": 1500.0})])
    line = next(x for x in out.splitlines() if x.startswith("m3-int8"))
    assert line.split()[2:] == ["1200", "1000", "1.20", "1500", "0.80", "1140", "0.95"]


def test_rerank_ratio_is_theirs_over_ours_so_above_one_is_ahead():
    out = throughput_table([_row("rerank-fp32", {"rerank_p50_ms": 20000.0}, {"rerank_p50_ms": 25000.0},
                                 {"rerank_p50_ms": 16000.0})])
    line = next(x for x in out.splitlines() if x.startswith("rerank-fp32"))
    assert line.split()[2:] == ["ms", "20000", "25000", "1.25", "16000", "0.80", "-", "-"]


def test_a_peer_that_did_not_run_says_why():
    out = throughput_table([_row("m3-fp32", {"ingest_tokens_per_s": 500.0}, {"skipped": "TEI is not built"})])
    assert "TEI: TEI is not built" in out and " - " in out
