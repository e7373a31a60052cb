"""Smoke run of the fused-MoE benchmark: it runs end to end on a tiny shape, with bf16 stacks and fp8 ones, W8A8 and
weight-only (and checks the product there), so it cannot rot between GPU runs, and the floors a reader compares against are finite, below the
measured time, and the ratios are what their names say."""
import math

import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_moe_benchmark_smoke_run_puts_the_layer_above_both_floors(tmp_path):
    run_smoke("moe.py", tmp_path, "--weights", "bf16,fp8,fp8-weight-only")
    rows = csv_rows(tmp_path / "moe.csv")
    assert [(row["weights"], row["tokens"]) for row in rows] == [
        (weights, tokens) for weights in ("bf16", "fp8", "fp8-weight-only") for tokens in ("4", "16")]
    assert "| tiny | fp8 | 16 |" in (tmp_path / "moe.md").read_text()
    # fp8 stacks stream one byte a weight: their floor per touched expert is half the bf16 stacks'.
    def per_expert(row):
        return float(row["weight_floor_ms"]) / int(row["touched_experts"])

    for bf16, w8a8, weight_only in zip(rows[:2], rows[2:4], rows[4:]):
        assert per_expert(w8a8) == pytest.approx(per_expert(bf16) / 2, rel=1e-3)
        assert per_expert(weight_only) == pytest.approx(per_expert(bf16) / 2, rel=1e-3)
    for row in rows:
        kernel_ms, weight_ms, compute_ms = (float(row[k]) for k in ("kernel_ms", "weight_floor_ms", "compute_floor_ms"))
        assert all(math.isfinite(v) and v > 0 for v in (kernel_ms, weight_ms, compute_ms))
        assert 0 < int(row["touched_experts"]) <= 8
        # Every stage of the default plan is timed, the router's top-k before the layer among them.
        assert all(math.isfinite(float(row[f"{stage}_ms"])) and float(row[f"{stage}_ms"]) > 0
                   for stage in ("topk", "route", "gate_up", "down"))
        # Floors are lower bounds from the same run's ceilings: the layer beats neither, on the CPU either.
        assert weight_ms < kernel_ms and compute_ms < kernel_ms
        assert float(row["vs_weight_floor"]) == pytest.approx(kernel_ms / weight_ms, rel=0.01)
        assert float(row["vs_compute_floor"]) == pytest.approx(kernel_ms / compute_ms, rel=0.01)


def test_moe_benchmark_routes_among_the_eligible_experts_only(tmp_path):
    """`--eligible N`: a forward's tokens reach fewer experts than uniform routing does; the tiles are timed there."""
    run_smoke("moe.py", tmp_path, "--weights", "fp8", "--tokens", "16", "--eligible", "3")
    rows = csv_rows(tmp_path / "moe.csv")
    assert [int(row["touched_experts"]) for row in rows] == [3]
