"""A smoke run of the warm-start benchmark on a tiny model on the CPU, so the script cannot rot between GPU runs:
a row per batch size and warm-up setting, times that are times, and a ratio that is first over second."""
import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_times_the_first_and_second_generate_of_each_batch(tmp_path):
    run_smoke("warm_start.py", tmp_path, "--cold", cpu=True)
    rows = csv_rows(tmp_path / "warm_start.csv")
    assert [(r["batch"], r["warm_up"]) for r in rows] == [("1", "True"), ("1", "False"), ("2", "True"),
                                                          ("2", "False")]
    for row in rows:
        first, second = float(row["first_s"]), float(row["second_s"])
        assert first > 0 and second > 0
        assert float(row["first_over_second"]) == pytest.approx(first / second, rel=2e-3)
        assert (float(row["warm_up_s"]) > 0) == (row["warm_up"] == "True")
    assert (tmp_path / "warm_start.md").read_text().startswith("| batch | warm-up |")
