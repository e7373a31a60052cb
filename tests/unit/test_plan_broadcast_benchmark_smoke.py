"""A smoke run of the plan-broadcast benchmark, so the script cannot rot: the pickled plan of a decode step of every
request, with each request's whole page table, and times that are times."""
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_pickles_the_decode_step_of_every_request(tmp_path):
    run_smoke("plan_broadcast.py", tmp_path, cpu=True)
    (row,) = csv_rows(tmp_path / "plan_broadcast.csv")
    assert (row["batch"], row["context"]) == ("4", "64")
    assert int(row["page_table_entries"]) >= 4 * 64 // 32  # each request's pages cover its context
    assert int(row["plan_bytes"]) > 0 and float(row["pickle_ms"]) > 0 and float(row["unpickle_ms"]) > 0
