"""benchmarks/interleave.py: one benchmark over two versions of the project, their processes in turn. What a reader
concludes from its table rests on the order of the runs, on which rows it compares with which, on which runs count,
and on the chance it gives; a run that overstays its budget or an interrupt must leave no process behind. Most
cases run small benchmark scripts in trees of their own (--head-tree, --base-tree); one real run compares this
repository's HEAD with itself on the CPU."""
from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import interleave  # noqa: E402

# A benchmark of the tests' own: it writes NAME.csv under --out with one row per case, at the tree's value plus a
# little per call, after what the tree's behaviour says (fail, sleep, start a child that outlives it).
FAKE = '''
import argparse, csv, os, subprocess, sys, time
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
here = Path(__file__).parent
value = float((here / "value").read_text())
behaviour = (here / "behaviour").read_text().split()
if "child" in behaviour:  # a grandchild of the tool, which a timeout or a stop must end too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (here / f"child-{os.getpid()}").write_text(str(child.pid))
if "sleep" in behaviour:
    time.sleep(60)
if "fail" in behaviour:
    sys.exit(3)
calls = len(list(here.glob("call-*")))
(here / f"call-{os.getpid()}").write_text("")
with open(args.out / "fake.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["case", "ms", "note"])
    writer.writerow(["a", value + 0.01 * calls, "x"])
    writer.writerow(["b", 10 * value, "x"])
'''


def fake_tree(root: Path, value: float, behaviour: str = "") -> Path:
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "fake.py").write_text(textwrap.dedent(FAKE))
    (root / "benchmarks" / "value").write_text(str(value))
    (root / "benchmarks" / "behaviour").write_text(behaviour)
    return root


def interleave_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "interleave.py"), "--out", str(out), *args]


def run_interleave(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(interleave_command(out, *args), cwd=REPO, capture_output=True, text=True, timeout=600)


def table(out: Path) -> list[dict]:
    with open(out / "interleave_compare.csv", newline="") as f:
        return list(csv.DictReader(f))


FAKE_ARGS = ["--devices", "cpu", "--min-seconds", "0", "--csv", "fake.csv", "--key", "case", "--metrics", "ms",
             "--", "fake.py"]


def test_each_device_runs_the_sides_abba_and_the_next_device_starts_with_the_base(tmp_path):
    plan = interleave.plan_runs(["0", "1"], 6, tmp_path)
    assert [[run.side for run in runs] for runs in plan] == [
        ["head", "base", "base", "head", "head", "base"], ["base", "head", "head", "base", "base", "head"]]
    names = [run.name for runs in plan for run in runs]
    assert len(set(names)) == len(names)  # every run writes its own folder and log


def test_the_chance_of_two_sides_of_one_version_falling_apart():
    assert interleave.chance_apart(2, 2) == pytest.approx(1 / 3)
    assert interleave.chance_apart(4, 4) == pytest.approx(1 / 35)
    assert interleave.chance_apart(3, 3) == pytest.approx(0.1)
    assert interleave.chance_apart(1, 1) == 1


def row(side: str, case: str, ms: str, step: str = "") -> dict:
    return dict(interleave_side=side, section="forward", model="m", case=case, engine_ms=ms, engine_step_ms=step)


def test_the_comparison_takes_each_row_s_runs_of_both_sides_and_says_whether_they_fall_apart():
    rows = [row("head", "b1", "2.0", "2.5"), row("base", "b1", "2.4", "2.4"), row("head", "b1", "2.2", "2.6"),
            row("base", "b1", "2.6", ""),  # an empty cell is no measurement
            row("head", "b32", "10", "nan"), row("base", "b32", "11", "12")]
    entries = interleave.compare(rows, ["section", "model", "case"], ["engine_ms", "engine_step_ms"])
    by_key = {(entry["case"], entry["metric"]): entry for entry in entries}
    b1 = by_key["b1", "engine_ms"]
    assert (b1["head"], b1["base"]) == ("2, 2.2", "2.4, 2.6")
    assert float(b1["head_mean"]) == pytest.approx(2.1) and float(b1["base_mean"]) == pytest.approx(2.5)
    assert float(b1["base_over_head"]) == pytest.approx(2.5 / 2.1, rel=1e-3)
    assert (b1["apart"], float(b1["chance_apart"])) == ("yes", pytest.approx(1 / 3, rel=1e-2))
    step = by_key["b1", "engine_step_ms"]
    assert (step["head"], step["base"], step["apart"], step["chance_apart"]) == ("2.5, 2.6", "2.4", "yes", "0.667")
    overlapping = interleave.compare([row("head", "x", "1.0"), row("base", "x", "0.9"), row("head", "x", "0.8")],
                                     ["case"], ["engine_ms"])[0]
    assert overlapping["apart"] == "no"
    one_side = by_key["b32", "engine_step_ms"]  # the head's only value is NaN: nothing to compare it with
    assert (one_side["head"], one_side["base"], one_side["base_over_head"], one_side["apart"]) == ("", "12", "", "")


def test_runs_of_two_trees_are_tabulated_side_by_side(tmp_path):
    head, base = fake_tree(tmp_path / "head", 1.0), fake_tree(tmp_path / "base", 2.0)
    out = tmp_path / "out"
    done = run_interleave(out, "--head-tree", str(head), "--base-tree", str(base), "--runs", "4", *FAKE_ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "interleave.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["interleave_run"], r["case"]) for r in rows][::2] == [
        ("d0-cpu-1-head", "a"), ("d0-cpu-2-base", "a"), ("d0-cpu-3-base", "a"), ("d0-cpu-4-head", "a")]
    a, b = (next(e for e in table(out) if e["case"] == case) for case in "ab")
    assert (a["head"], a["base"]) == ("1, 1.01", "2, 2.01")  # each tree's runs, in their order
    assert (a["apart"], float(a["chance_apart"]), float(a["base_over_head"])) == ("yes", pytest.approx(1 / 3, rel=1e-2),
                                                                                  pytest.approx(2.005 / 1.005, rel=1e-3))
    assert (b["head"], b["base"]) == ("10, 10", "20, 20")
    markdown = (out / "interleave.md").read_text()
    assert f"- head: {head}" in markdown and f"- base: {base}" in markdown
    assert all(f"- {name}: exit 0" in markdown for name in ("d0-cpu-1-head", "d0-cpu-2-base", "d0-cpu-4-head"))


def test_the_runs_of_a_version_that_fails_are_listed_and_never_compared(tmp_path):
    head, base = fake_tree(tmp_path / "head", 1.0), fake_tree(tmp_path / "base", 2.0, "fail")
    out = tmp_path / "out"
    done = run_interleave(out, "--head-tree", str(head), "--base-tree", str(base), "--runs", "4", *FAKE_ARGS)
    assert done.returncode == 1
    assert "d0-cpu-2-base, d0-cpu-3-base" in done.stderr and "no row has a metric measured on both sides" in done.stderr
    assert "- d0-cpu-2-base: exit 3" in (out / "interleave.md").read_text()
    assert all(entry["base"] == "" and entry["apart"] == "" for entry in table(out))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended; its parent, init here, has not reaped it yet
        return f.read().split(") ")[1][0] != "Z"


def children(tree: Path) -> list[int]:
    return [int(path.read_text()) for path in (tree / "benchmarks").glob("child-*")]


def test_a_run_past_its_budget_ends_with_everything_it_started(tmp_path):
    head, base = fake_tree(tmp_path / "head", 1.0, "child sleep"), fake_tree(tmp_path / "base", 2.0)
    out = tmp_path / "out"
    start = time.monotonic()
    done = run_interleave(out, "--head-tree", str(head), "--base-tree", str(base), "--runs", "4", "--budget", "3",
                          *FAKE_ARGS)
    assert time.monotonic() - start < 30 and done.returncode == 1
    assert "- d0-cpu-1-head: ran out of the budget" in (out / "interleave.md").read_text()
    (pid,) = children(head)
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def test_sigterm_stops_the_runs_and_tabulates_those_that_finished(tmp_path):
    head, base = fake_tree(tmp_path / "head", 1.0, "child sleep"), fake_tree(tmp_path / "base", 2.0)
    out = tmp_path / "out"
    tool = subprocess.Popen(interleave_command(out, "--head-tree", str(head), "--base-tree", str(base), "--runs", "4",
                                               *FAKE_ARGS), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not children(head) and time.monotonic() < deadline:
        time.sleep(0.1)
    (pid,) = children(head)
    tool.send_signal(signal.SIGTERM)
    _, stderr = tool.communicate(timeout=30)
    assert tool.returncode == 1, stderr[-2000:]
    markdown = (out / "interleave.md").read_text()
    assert "- d0-cpu-1-head: stopped" in markdown and "- d0-cpu-2-base: stopped before it started" in markdown
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


@pytest.mark.parametrize("edit, message", [
    (dict(key="note"), "name more than one row"),  # "x" twice in one run's CSV
    (dict(metrics="msx"), "no fake.csv has the columns ['msx']"),
    (dict(column="interleave_side"), "columns named as the tool's own: ['interleave_side']"),
])
def test_a_key_that_names_no_single_row_and_a_missing_metric_are_refused_by_name(tmp_path, edit, message):
    head, base = fake_tree(tmp_path / "head", 1.0), fake_tree(tmp_path / "base", 2.0)
    if "column" in edit:
        for tree in (head, base):
            script = tree / "benchmarks" / "fake.py"
            script.write_text(script.read_text().replace('"note"]', f'"{edit["column"]}"]'))
    args = [a for a in FAKE_ARGS]
    args[args.index("--key") + 1] = edit.get("key", "case")
    args[args.index("--metrics") + 1] = edit.get("metrics", "ms")
    done = run_interleave(tmp_path / "out", "--head-tree", str(head), "--base-tree", str(base), "--runs", "4", *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


def test_a_run_over_head_and_itself_on_the_cpu_tabulates_every_run_s_rows(tmp_path):
    """This repository's HEAD against the checkout as it is, with a real benchmark: the plan broadcast's byte
    counts are the same code's, so equal on both sides (a ratio of exactly 1, not apart); both sides' times are
    there."""
    out = tmp_path / "out"
    done = run_interleave(out, "--base", "HEAD", "--runs", "4", "--devices", "cpu", "--csv", "plan_broadcast.csv",
                          "--key", "way", "--metrics", "plan_bytes,send_ms",
                          "--", "plan_broadcast.py", "--smoke", "--repeats", "3")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(out / "interleave.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["interleave_run"], r["interleave_side"]) for r in rows} == {
        ("d0-cpu-1-head", "head"), ("d0-cpu-2-base", "base"), ("d0-cpu-3-base", "base"), ("d0-cpu-4-head", "head")}
    entries = table(out)
    assert {e["way"] for e in entries} == {"pickled whole", "wire form"} and len(entries) == 4
    for entry in entries:
        if entry["metric"] == "plan_bytes":
            assert entry["head"] == entry["base"] and float(entry["base_over_head"]) == 1 and entry["apart"] == "no"
        else:
            assert math.isfinite(float(entry["base_over_head"]))
    assert f"- base: {subprocess.check_output(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, text=True).strip()}" \
        in (out / "interleave.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--base", "no-such-commit-anywhere", "--", "plan_broadcast.py"],
     "--base 'no-such-commit-anywhere' is not a commit"),
    (["--base", "HEAD", "plan_broadcast.py"], "name the benchmark after `--`"),
    (["--base", "HEAD", "--", "plan_broadcast.py", "--out", "x"], "each run gets an --out of its own"),
    (["--base", "HEAD", "--", "plan_broadcast.py", "--out=x"], "each run gets an --out of its own"),
    (["--base", "HEAD", "--devices", "cpu", "--", "no_such_benchmark.py"], "has no benchmarks/no_such_benchmark.py"),
    (["--base", "HEAD", "--", str(REPO / "benchmarks" / "plan_broadcast.py")], "a script of benchmarks/ by its name"),
    (["--base", "HEAD", "--devices", "0,00", "--", "plan_broadcast.py"], "names a device twice"),
    (["--base", "HEAD", "--devices", "cpu,0", "--", "plan_broadcast.py"], "mixes cpu with GPUs"),
    (["--base", "HEAD", "--devices", "gpu0", "--", "plan_broadcast.py"], "GPU numbers or cpu"),
    (["--base", "HEAD", "--devices", "cpu", "--runs", "2", "--", "plan_broadcast.py"],
     "gives 1 run(s) of the head and 1 of the base"),
    (["--base", "HEAD", "--devices", "cpu", "--runs", "0", "--", "plan_broadcast.py"], "--runs must be at least 1"),
    (["--base", "HEAD", "--budget", "nan", "--", "plan_broadcast.py"], "--budget must be a positive number"),
    (["--base", "HEAD", "--key", "case,metric", "--", "plan_broadcast.py"], "collide with the comparison's"),
])
def test_a_bad_invocation_is_refused_by_name_and_runs_nothing(tmp_path, args, message):
    out = tmp_path / "out"
    done = run_interleave(out, *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    assert not out.exists()  # no run started, and no folder of results pretends one did


def test_an_out_that_is_a_file_or_holds_files_is_refused(tmp_path):
    for out in (tmp_path / "file", tmp_path / "full"):
        if out.name == "file":
            out.write_text("")
        else:
            out.mkdir()
            (out / "kept").write_text("")
        done = run_interleave(out, "--base", "HEAD", "--devices", "cpu", "--", "plan_broadcast.py")
        assert done.returncode != 0 and "is not an empty folder" in done.stderr
