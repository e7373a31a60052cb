"""A smoke run of the page-retention benchmark on a tiny model, so the script that measures retention on the GPU
cannot rot between runs: each ratio's KV pages per request are what the pool's accounting must show (the 8 pages
of the 256-token prompt, then the budget ceil(ratio x 8), never under 2), and its ratios divide what they say."""
import math

import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_reports_the_pages_each_ratio_keeps(tmp_path):
    run_smoke("retention.py", tmp_path, "--batches", "1,2")
    rows = csv_rows(tmp_path / "retention.csv")
    assert [(r["batch"], r["retention_ratio"]) for r in rows] == [
        (b, r) for b in ("1", "2") for r in ("1", "0.5", "0.3")]
    for row in rows:
        ratio = float(row["retention_ratio"])
        assert float(row["kv_pages_per_request"]) == max(2, math.ceil(ratio * 8))
        dense = next(r for r in rows if r["batch"] == row["batch"] and r["retention_ratio"] == "1")
        assert float(row["step_vs_dense"]) == pytest.approx(float(row["step_ms"]) / float(dense["step_ms"]), rel=2e-3)
        # A page of the smoke model: K and V x 2 layers x 32 slots x 4 heads x 16 dims x 4 bytes = 1/32 MiB.
        assert float(row["kv_mib_per_request"]) == pytest.approx(float(row["kv_pages_per_request"]) / 32, rel=1e-3)
    assert (tmp_path / "retention.md").read_text().startswith("`python benchmarks/retention.py --smoke")
