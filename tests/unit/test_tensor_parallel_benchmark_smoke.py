"""A smoke run of the tensor-parallel benchmark on two CPU ranks, so the script that measures TP on GPUs cannot rot
between runs on a machine with two of them: its rows are there, the two ranks' outputs equal one rank's, their first
logits differ from one rank's by float32 rounding, the collectives are counted on the two-rank rows only, the
host-time table splits each step into its phases, and rank 0's longest host calls are listed, longest first."""

import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_compares_two_ranks_with_one(tmp_path):
    run_smoke("tensor_parallel.py", tmp_path)
    rows = csv_rows(tmp_path / "tensor_parallel.csv")
    # Each engine's rows as it ends, so that a run cut short keeps what it measured.
    assert [(r["tp"], r["batch"]) for r in rows] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    for row in rows:
        assert row["outputs"] == "equal"
        assert float(row["speedup"]) == pytest.approx(
            float(next(r for r in rows if r["tp"] == "1" and r["batch"] == row["batch"])["step_ms"])
            / float(row["step_ms"]), rel=2e-3)
        assert (float(row["collective_ms"]) > 0) == (row["tp"] == "2")
        assert float(row["norm_ms"]) == 0  # a device kernel's time: CPU ranks launch none
        assert float(row["ideal_speedup"]) == int(row["tp"])
        # Summed in another order over two ranks: rounding, far under the logits' own size.
        assert (float(row["logit_rel_diff"]) == 0) == (row["tp"] == "1")
        assert float(row["logit_rel_diff"]) < 1e-5
    assert (tmp_path / "tensor_parallel.md").read_text().startswith("`python benchmarks/tensor_parallel.py --smoke")
    host = csv_rows(tmp_path / "tensor_parallel_host.csv")
    assert [(r["tp"], r["batch"]) for r in host] == [(r["tp"], r["batch"]) for r in rows]
    for row in host:
        # The phases are disjoint spans of the step: the update, the step's remainder, is never negative.
        assert min(float(v) for k, v in row.items() if k.endswith("_ms")) >= 0
        assert (float(row["broadcast_ms"]) > 0) == (row["tp"] == "2")
        assert float(row["forward_launch_ms"]) > 0 and float(row["read_back_ms"]) > 0
        assert float(row["sampler_inputs_ms"]) > 0
    assert (tmp_path / "tensor_parallel_host.md").read_text().startswith("`python benchmarks/tensor_parallel.py --smoke")
    ops = csv_rows(tmp_path / "tensor_parallel_ops.csv")
    # On CPU ranks no kernel runs on a device: the host's calls alone.
    assert {r["side"] for r in ops} == {"host"}
    for tp, batch in [(r["tp"], r["batch"]) for r in rows]:
        mine = [r for r in ops if (r["tp"], r["batch"]) == (tp, batch)]
        assert len(mine) == 12
        times = [float(r["self_ms_per_step"]) for r in mine]
        assert times == sorted(times, reverse=True) and times[-1] > 0
        assert all(float(r["calls_per_step"]) > 0 for r in mine)
