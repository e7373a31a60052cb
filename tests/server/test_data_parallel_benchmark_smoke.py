"""A smoke run of benchmarks/data_parallel.py, not a measurement: its --smoke mode end to end (a tiny random model,
one KIND_CPU instance and then two, each under perf_analyzer through its own tritonserver), so the script that
measures data parallelism on GPUs cannot rot between runs on a machine with two of them."""

import pytest
from benchmark_smoke import csv_rows, run_smoke


@pytest.mark.timeout(600)
def test_smoke_run_loads_one_instance_then_two(tmp_path):
    run_smoke("data_parallel.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "data_parallel.csv")
    assert [(row["instances"], row["kind"], row["concurrency"]) for row in rows] == \
        [("1", "KIND_CPU", "4"), ("2", "KIND_CPU", "4")]
    for row in rows:
        assert int(row["requests"]) >= 8 and float(row["requests_per_s"]) > 0 and float(row["output_tokens_per_s"]) > 0
        assert float(row["ideal_speedup"]) == int(row["instances"])
    assert float(rows[0]["speedup"]) == 1
    assert float(rows[1]["speedup"]) == pytest.approx(
        float(rows[1]["output_tokens_per_s"]) / float(rows[0]["output_tokens_per_s"]), rel=2e-3)
    assert (tmp_path / "data_parallel.md").read_text().startswith("`python benchmarks/data_parallel.py --smoke")
