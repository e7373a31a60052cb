"""A smoke run of the tensor-parallel benchmark on two CPU ranks, so the script that measures TP on GPUs cannot rot
between runs on a machine with two of them: its rows are there, the two ranks' outputs equal one rank's, and the
collectives are counted on the two-rank rows only."""

import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_compares_two_ranks_with_one(tmp_path):
    run_smoke("tensor_parallel.py", tmp_path)
    rows = csv_rows(tmp_path / "tensor_parallel.csv")
    assert [(r["tp"], r["batch"]) for r in rows] == [("1", "1"), ("2", "1"), ("1", "2"), ("2", "2")]
    for row in rows:
        assert row["outputs"] == "equal"
        assert float(row["speedup"]) == pytest.approx(
            float(next(r for r in rows if r["tp"] == "1" and r["batch"] == row["batch"])["step_ms"])
            / float(row["step_ms"]), rel=2e-3)
        assert (float(row["collective_ms"]) > 0) == (row["tp"] == "2")
        assert float(row["ideal_speedup"]) == int(row["tp"])
    assert (tmp_path / "tensor_parallel.md").read_text().startswith("`python benchmarks/tensor_parallel.py --smoke")
