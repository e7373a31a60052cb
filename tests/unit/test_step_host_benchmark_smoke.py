"""A smoke run of benchmarks/step_host.py, not a measurement: its --smoke mode end to end on the CPU, every setting
timed, so the script cannot rot between GPU runs."""
import math

from benchmark_smoke import csv_rows, run_smoke

SETTINGS = ["alone, the device idle", "as the engine runs", "garbage collector off",
            "batch built twice, the second timed", "pinned buffer kept"]


def test_step_host_smoke_run_times_the_host_parts_in_every_setting(tmp_path):
    run_smoke("step_host.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "step_host.csv")
    assert [row["setting"] for row in rows] == SETTINGS
    for row in rows:
        assert 0 < float(row["build_batch_us"]) < math.inf and 0 < float(row["host_buffer_us"]) < math.inf
        if row["round"] != "0":  # the steps' rows: the step holds the forward's call, which holds the graph or model
            assert 0 < float(row["forward_call_us"]) < 1e3 * float(row["step_ms"])
    assert (tmp_path / "step_host.md").read_text().startswith("`python benchmarks/step_host.py --smoke --out")
