"""A smoke run of the tensor-parallel benchmark on two CPU ranks, so the script that measures TP on GPUs cannot rot
between runs on a machine with two of them: its rows are there, the two ranks' outputs equal one rank's, and the
collectives are counted on the two-rank rows only."""
import csv
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_smoke_run_compares_two_ranks_with_one(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "benchmarks/tensor_parallel.py", "--smoke", "--out", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "tensor_parallel.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["tp"], r["batch"]) for r in rows] == [("1", "1"), ("2", "1"), ("1", "2"), ("2", "2")]
    for row in rows:
        assert row["outputs"] == "equal"
        assert float(row["speedup"]) == pytest.approx(
            float(next(r for r in rows if r["tp"] == "1" and r["batch"] == row["batch"])["step_ms"])
            / float(row["step_ms"]), rel=2e-3)
        assert (float(row["collective_ms"]) > 0) == (row["tp"] == "2")
        assert float(row["ideal_speedup"]) == int(row["tp"])
    assert (tmp_path / "tensor_parallel.md").read_text().startswith("`python benchmarks/tensor_parallel.py --smoke")
