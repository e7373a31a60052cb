"""Smoke runs of the kernel and matmul benchmarks: each script runs end to end on a tiny shape, so it cannot rot
between GPU runs, and the ratios a reader takes from its table are there, finite, and what their names say."""
import math

import pytest
from benchmark_smoke import csv_rows, run_smoke

KERNELS = [
    "paged_attention", "paged_attention sweep", "store_kv", "sample_and_confidence", "sample_and_confidence sweep",
    "accept_tokens", "rmsnorm", "fused_add_rmsnorm",
]


def test_kernel_benchmark_smoke_run_puts_every_kernel_above_its_floor(tmp_path):
    run_smoke("kernels.py", tmp_path)
    table = (tmp_path / "kernels.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert sorted({row[0].lstrip("| ") for row in rows}) == sorted(KERNELS)
    for row in rows:
        kernel_ms, floor_ms, ratio = float(row[2]), float(row[3]), float(row[4])
        assert math.isfinite(ratio) and ratio == pytest.approx(kernel_ms / floor_ms, rel=0.01, abs=0.01)
        # The floor is a lower bound from the same run's ceilings: no kernel beats it, on the CPU either.
        assert ratio > 1


def test_matmul_benchmark_smoke_run_compares_every_case_with_cublas(tmp_path):
    run_smoke("linear.py", tmp_path)
    rows = csv_rows(tmp_path / "linear.csv")
    assert [row["tokens"] for row in rows] == ["4", "16"]
    for row in rows:
        ratio = float(row["engine_vs_cublas"])
        assert math.isfinite(ratio) and ratio > 0
        assert ratio == pytest.approx(float(row["engine_ms"]) / float(row["cublas_ms"]), rel=0.01)
