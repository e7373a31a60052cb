"""A smoke run of the plan-broadcast benchmark, so the script cannot rot: the plan of a decode step of every request,
with each request's whole page table, sent pickled whole and in its wire form, which is the smaller once the
requests' records have been sent; the trip of that frame to a worker process, down its pipe and over the gloo group
that carried it before; and times that are times."""
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_sends_the_decode_step_of_every_request_both_ways(tmp_path):
    run_smoke("plan_broadcast.py", tmp_path, cpu=True)
    whole, wire = csv_rows(tmp_path / "plan_broadcast.csv")
    assert (whole["way"], wire["way"]) == ("pickled whole", "wire form")
    for row in (whole, wire):
        assert (row["batch"], row["context"]) == ("4", "64")
        assert int(row["page_table_entries"]) >= 4 * 64 // 32  # each request's pages cover its context
        assert float(row["send_ms"]) > 0 and float(row["receive_ms"]) > 0
    assert 0 < int(wire["plan_bytes"]) < int(whole["plan_bytes"])
    gloo, gloo_frame, pipe = csv_rows(tmp_path / "plan_broadcast_trip.csv")
    assert [row["way"] for row in (gloo, gloo_frame, pipe)] == [
        "gloo broadcast (before)", "gloo broadcast of the frame alone", "pipe (workers.Channel)"]
    for row in (gloo, gloo_frame, pipe):
        assert int(row["frame_bytes"]) > int(wire["plan_bytes"])  # the size's header, then the pickled plan
        assert 0 < float(row["send_ms"]) <= float(row["trip_ms"])
