"""A smoke run of benchmarks/serving.py, not a measurement: its --smoke mode end to end (a tiny random model on
this machine, in process, through the engine loop, then through its own tritonserver and the OpenAI front in front
of it). The benchmark's numbers
mean something only on a GPU; what must hold everywhere is that the served requests return exactly what the
engine returns in process, and that the report it writes carries a finite ratio for each batch size."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


@pytest.mark.timeout(600)
def test_serving_benchmark_smoke_run(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(BENCHMARK), "--smoke", "--front", "--out", str(out)],
                         capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    with open(out / "serving.csv") as f:
        rows = list(csv.DictReader(f))
    rounds = {(row["mode"], int(row["batch"]), row["round"]): row for row in rows}
    for batch in (1, 2):
        inproc, loop, served = (rounds[mode, batch, "0"] for mode in ("in-process", "engine-loop", "served"))
        # Same prompts, same greedy settings: the served output_ids and the engine loop's are the in-process ones.
        assert served["outputs_equal"] == "True", served
        assert loop["outputs_equal"] == "True", loop
        assert int(served["output_tokens"]) == int(inproc["output_tokens"]) == batch * 16
        ratio = float(served["seconds"]) / float(inproc["seconds"])
        assert math.isfinite(ratio) and ratio > 0
        assert f"| {batch} |" in (out / "serving.md").read_text()
        # Through the OpenAI front: the texts of the in-process tokens, and every token counted.
        front = rounds["front", batch, "0"]
        assert front["outputs_equal"] == "True", front
        assert int(front["output_tokens"]) == batch * 16
    assert "## Through the OpenAI front" in (out / "serving.md").read_text()
