"""benchmarks/interleave.py: one benchmark over two versions of the project, their processes in turn. What a reader
concludes from its table rests on the order of the runs, on which rows it compares with which, and on its
disjointness, so those are held here; and one real run over this repository's HEAD on the CPU."""
from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import interleave  # noqa: E402


def test_each_device_alternates_the_sides_and_the_next_device_starts_with_the_other(tmp_path):
    plan = interleave.plan_runs(["0", "1", "cpu"], 3, tmp_path)
    assert [[run.side for run in runs] for runs in plan] == [["head", "base", "head"], ["base", "head", "base"],
                                                             ["head", "base", "head"]]
    names = [run.name for runs in plan for run in runs]
    assert len(set(names)) == len(names)  # every run writes its own folder and log


def row(side: str, order: int, case: str, ms: str, step: str = "") -> dict:
    return dict(run=f"d0-0-{order}-{side}", device="0", order=order, side=side, section="forward", model="m",
                case=case, engine_ms=ms, engine_step_ms=step)


def test_the_comparison_takes_each_row_s_runs_of_both_sides_and_says_whether_they_are_disjoint():
    rows = [row("head", 1, "b1", "2.0", "2.5"), row("base", 2, "b1", "2.4", "2.4"), row("head", 3, "b1", "2.2", "2.6"),
            row("base", 4, "b1", "2.6", ""),  # an empty cell is no measurement
            row("head", 1, "b32", "10", "nan"), row("base", 2, "b32", "11", "12")]
    table = interleave.compare(rows, ["section", "model", "case"], ["engine_ms", "engine_step_ms"])
    by_key = {(entry["case"], entry["metric"]): entry for entry in table}
    b1 = by_key["b1", "engine_ms"]
    assert (b1["head"], b1["base"]) == ("2, 2.2", "2.4, 2.6")
    assert float(b1["head_mean"]) == pytest.approx(2.1) and float(b1["base_mean"]) == pytest.approx(2.5)
    assert float(b1["base_over_head"]) == pytest.approx(2.5 / 2.1, rel=1e-3)
    assert b1["disjoint"] == "yes"
    step = by_key["b1", "engine_step_ms"]
    assert (step["head"], step["base"], step["disjoint"]) == ("2.5, 2.6", "2.4", "yes")
    overlapping = interleave.compare([row("head", 1, "x", "1.0"), row("base", 2, "x", "0.9"),
                                      row("head", 3, "x", "0.8")], ["case"], ["engine_ms"])[0]
    assert overlapping["disjoint"] == "no"
    one_side = by_key["b32", "engine_step_ms"]  # the head's only value is NaN: nothing to compare it with
    assert (one_side["head"], one_side["base"], one_side["base_over_head"]) == ("", "12", "")


def run_interleave(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "interleave.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_a_run_over_head_and_its_base_on_the_cpu_tabulates_every_run_s_rows(tmp_path):
    """HEAD against itself: the plan broadcast's byte counts are the same code's, so equal on both sides (a ratio
    of exactly 1, not disjoint); the times are there for both sides, from both runs."""
    done = run_interleave("--out", str(tmp_path / "out"), "--base", "HEAD", "--runs", "2", "--devices", "cpu",
                          "--csv", "plan_broadcast.csv", "--key", "way", "--metrics", "plan_bytes,send_ms",
                          "--", "plan_broadcast.py", "--smoke", "--repeats", "3")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(tmp_path / "out" / "interleave.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["run"], r["side"]) for r in rows} == {("d0-cpu-1-head", "head"), ("d0-cpu-2-base", "base")}
    assert {r["way"] for r in rows} == {"pickled whole", "wire form"}
    table = (tmp_path / "out" / "interleave.md").read_text()
    assert "- d0-cpu-1-head: exit 0" in table and "- d0-cpu-2-base: exit 0" in table
    lines = [[cell.strip("| ") for cell in line.split(" | ")] for line in table.splitlines()
             if line.startswith("| ") and "---" not in line]
    entries = [dict(zip(lines[0], line)) for line in lines[1:]]
    assert len(entries) == 4
    for entry in entries:
        if entry["metric"] == "plan_bytes":
            assert entry["head"] == entry["base"] and float(entry["base_over_head"]) == 1
            assert entry["disjoint"] == "no"
        else:
            assert math.isfinite(float(entry["base_over_head"]))


@pytest.mark.parametrize("args, message", [
    (["--base", "no-such-commit-anywhere", "--", "plan_broadcast.py"],
     "--base 'no-such-commit-anywhere' is not a commit"),
    (["--base", "HEAD", "plan_broadcast.py"], "name the benchmark after `--`"),
    (["--base", "HEAD", "--", "plan_broadcast.py", "--out", "x"], "each run gets an --out of its own"),
    (["--base", "HEAD", "--", "no_such_benchmark.py"], "has no benchmarks/no_such_benchmark.py"),
    (["--base", "HEAD", "--devices", "0,0", "--", "plan_broadcast.py"], "names a GPU twice"),
    (["--base", "HEAD", "--devices", "gpu0", "--", "plan_broadcast.py"], "CUDA device numbers or cpu"),
    (["--base", "HEAD", "--runs", "0", "--", "plan_broadcast.py"], "--runs must be at least 1"),
    (["--base", "HEAD", "--budget", "nan", "--", "plan_broadcast.py"], "--budget must be a positive number"),
])
def test_a_bad_invocation_is_refused_by_name_and_runs_nothing(tmp_path, args, message):
    out = tmp_path / "out"
    done = run_interleave("--out", str(out), *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    assert not out.exists()  # no run started, and no folder of results pretends one did
