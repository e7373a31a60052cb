"""A smoke run of the LoRA benchmark on a tiny model on the CPU, so the script cannot rot between GPU runs: every
case of every batch is in its table, with the adapters it says, its ratios against the merged step are what their
names say, and the unmerged step under adapter 0 gives the merged step's logits."""
import re

import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_reports_each_case_against_merged(tmp_path):
    run_smoke("lora.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "lora.csv")
    assert [(r["batch"], r["case"], r["distinct_adapters"]) for r in rows] == [
        ("1", "merged", "0"), ("1", "unmerged, no adapter rows", "0"), ("1", "unmerged, mixed", "1"),
        ("2", "merged", "0"), ("2", "unmerged, no adapter rows", "0"), ("2", "unmerged, mixed", "2")]
    merged = {r["batch"]: r for r in rows if r["case"] == "merged"}
    for row in rows:
        for kind in ("forward", "step"):
            value = float(row[f"{kind}_vs_merged"])
            # Each column is written to 4 significant digits.
            assert value == pytest.approx(float(row[f"{kind}_ms"]) / float(merged[row["batch"]][f"{kind}_ms"]),
                                          rel=2e-3)
        assert float(row["forward_vs_weight_floor"]) == pytest.approx(
            float(row["forward_ms"]) / float(row["weight_floor_ms"]), rel=2e-3)
        assert float(row["weight_floor_ms"]) > 0 and float(row["compute_floor_ms"]) > 0
        # The deltas alone are timed for the mixed case only, the one that computes them.
        assert (float(row["delta_ms"]) > 0) if row["case"] == "unmerged, mixed" else row["delta_ms"] == ""
    report = (tmp_path / "lora.md").read_text()
    assert report.startswith("`python benchmarks/lora.py --smoke")
    error = float(re.search(r"relative error ([0-9.e+-]+)", report)[1])
    assert error < 1e-4  # float32: the delta applied per request is the merged weights' up to rounding
