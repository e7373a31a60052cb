"""One benchmark over two versions of the project, their processes interleaved, to see a change smaller than what
separates two runs of one version.

Two processes of the same code on one machine differ by up to several percent (docs/performance.md), so a change
timed once against one run of its base says nothing below that. Here each device runs the two versions in turn,
head then base then head..., and a second device in the opposite order, so the machine's drift falls on both; a
difference shows when every run of one version is faster than every run of the other.

    python benchmarks/interleave.py --out DIR --base 4dc8b65 --runs 3 --devices 0,1 -- \\
        forward.py --models llada2-mini --sections forward --quantization none,fp8 --batches 1 --contexts 512

The head is this checkout's tree (or --head-tree), the base a commit that `git archive` exports (or --base-tree, a
tree exported already, for a machine without the repository's history). Each process runs the benchmark from its
tree's benchmarks/ with PYTHONPATH at the tree, on its device (CUDA_VISIBLE_DEVICES; `cpu` hides every GPU and runs
the kernels under Triton's interpreter), with a Triton cache of its tree and device and an --out of its own, under
the time left of --budget seconds. Then:
  * interleave.csv: every row of every run's --csv (forward.csv by default), after the run's device, order and
    side;
  * interleave.md: for each row (its --key columns) and each --metrics column, both sides' values in run order,
    their means, the base's mean over the head's, and whether the two sides' runs are disjoint.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("head", "base")


@dataclass
class Run:
    slot: int  # the device's place in --devices
    device: str  # a CUDA device number, or cpu
    order: int  # 1, 2, ... on its device
    side: str  # "head" or "base"
    out: Path
    returncode: int | None = None  # None: skipped, the budget spent; -1: it ran out of the budget

    @property
    def name(self) -> str:
        return f"d{self.slot}-{self.device}-{self.order}-{self.side}"


def plan_runs(devices: list[str], runs: int, out: Path) -> list[list[Run]]:
    """Each device's runs in its order: the sides alternate, the odd devices starting with the base."""
    return [[Run(k, device, i + 1, SIDES[(i + k) % 2], out) for i in range(runs)]
            for k, device in enumerate(devices)]


def export_commit(commit: str, into: Path) -> Path:
    """The tree of `commit` in this repository, written under `into`; raises SystemExit naming the commit when git
    cannot export it."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"interleave: --base {commit!r} is not a commit git can export here: "
                         f"{archive.stderr.decode(errors='replace').strip()}")
    tree = into / "base"
    tree.mkdir(parents=True)
    with tempfile.TemporaryFile() as tar_file:
        tar_file.write(archive.stdout)
        tar_file.seek(0)
        with tarfile.open(fileobj=tar_file) as tar:
            tar.extractall(tree, filter="tar")
    return tree


def run_device(runs: list[Run], trees: dict[str, Path], benchmark: list[str], deadline: float,
               min_seconds: float, caches: Path) -> None:
    for run in runs:
        left = deadline - time.monotonic()
        if left < min_seconds:
            continue
        tree = trees[run.side]
        env = dict(os.environ, PYTHONPATH=str(tree), TRITON_CACHE_DIR=str(caches / f"{run.side}-{run.device}"))
        if run.device == "cpu":  # no GPU: the kernels run under Triton's interpreter, as CI runs them
            env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        else:
            env.update(CUDA_VISIBLE_DEVICES=run.device)
        out = run.out / run.name
        out.mkdir(parents=True)
        with open(run.out / f"{run.name}.log", "w") as log:
            try:
                done = subprocess.run([sys.executable, *benchmark, "--out", str(out)], cwd=tree / "benchmarks",
                                      env=env, stdout=log, stderr=subprocess.STDOUT, timeout=left)
                run.returncode = done.returncode
            except subprocess.TimeoutExpired:
                run.returncode = -1
                print(f"ran out of the budget after {left:.0f} s", file=log)


def read_rows(runs: list[Run], csv_name: str) -> tuple[list[str], list[dict]]:
    """Every row of the runs' CSVs, after the run's device, order and side; the CSV's own columns."""
    columns: list[str] = []
    rows = []
    for run in runs:
        path = run.out / run.name / csv_name
        if run.returncode is None or not path.exists():
            continue
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns += [c for c in reader.fieldnames or [] if c not in columns]
            rows += [dict(run=run.name, device=run.device, order=run.order, side=run.side, **row) for row in reader]
    return columns, rows


def compare(rows: list[dict], key: list[str], metrics: list[str]) -> list[dict]:
    """Per row key and metric: each side's values in run order (device by device), their means, base over head,
    and whether every run of one side is below every run of the other."""
    groups: dict[tuple, dict[str, dict[str, list[float]]]] = {}
    for row in rows:
        for metric in metrics:
            try:
                value = float(row.get(metric) or "nan")
            except ValueError:
                continue
            if value == value:  # not NaN: an empty cell is no measurement
                sides = groups.setdefault((*(row.get(k, "") for k in key), metric), {s: [] for s in SIDES})
                sides[row["side"]].append(value)
    table = []
    for (*names, metric), sides in groups.items():
        head, base = sides["head"], sides["base"]
        entry = dict(zip(key, names), metric=metric, head=", ".join(f"{v:.4g}" for v in head),
                     base=", ".join(f"{v:.4g}" for v in base), head_mean="", base_mean="", base_over_head="",
                     disjoint="")
        if head and base:
            head_mean, base_mean = statistics.mean(head), statistics.mean(base)
            entry.update(head_mean=f"{head_mean:.4g}", base_mean=f"{base_mean:.4g}",
                         base_over_head=f"{base_mean / head_mean:.4g}" if head_mean else "",
                         disjoint="yes" if max(head) < min(base) or max(base) < min(head) else "no")
        table.append(entry)
    return table


def write(out: Path, columns: list[str], rows: list[dict], table: list[dict], runs: list[Run],
          command: str) -> None:
    with open(out / "interleave.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["run", "device", "order", "side", *columns])
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"`{command}`", ""]
    lines += [f"- {run.name}: " + ("skipped: the budget was spent" if run.returncode is None else
                                   "ran out of the budget" if run.returncode == -1 else f"exit {run.returncode}")
              for run in runs]
    if table:
        fields = list(table[0])
        lines += ["", "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
        lines += ["| " + " | ".join(str(entry[f]) for f in fields) + " |" for entry in table]
    (out / "interleave.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("interleave: name the benchmark after `--`, e.g. `-- forward.py --models llada-8b`")
    split = argv.index("--")
    own, benchmark = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    sides = parser.add_mutually_exclusive_group(required=True)
    sides.add_argument("--base", help="the commit to compare with, exported by git archive")
    sides.add_argument("--base-tree", type=Path, help="the base, a tree exported already")
    parser.add_argument("--head-tree", type=Path, default=REPO, help="the head (default: this checkout)")
    parser.add_argument("--runs", type=int, default=4, help="runs on each device, the sides in turn")
    parser.add_argument("--devices", help="comma-separated CUDA device numbers, or cpu (default: every GPU, else cpu)")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds for every run together")
    parser.add_argument("--min-seconds", type=float, default=60.0, help="a run starts only with this much budget left")
    parser.add_argument("--csv", default="forward.csv", help="the benchmark's CSV under its --out")
    parser.add_argument("--key", default="section,model,case", help="the CSV's columns that name a row")
    parser.add_argument("--metrics", default="engine_ms,engine_step_ms", help="the CSV's columns to compare")
    args = parser.parse_args(own)
    if not benchmark or not benchmark[0].endswith(".py"):
        raise SystemExit(f"interleave: the benchmark after `--` is a script of benchmarks/, got {benchmark[:1]}")
    if args.runs < 1:
        raise SystemExit(f"interleave: --runs must be at least 1, got {args.runs}")
    if not (0 < args.budget < float("inf") and 0 <= args.min_seconds < float("inf")):
        raise SystemExit(f"interleave: --budget must be a positive number of seconds and --min-seconds one not "
                         f"below 0, got {args.budget} and {args.min_seconds}")
    if "--out" in benchmark:
        raise SystemExit("interleave: each run gets an --out of its own; give the benchmark none")
    if args.devices is None:
        import torch

        count = torch.cuda.device_count()
        args.devices = ",".join(map(str, range(count))) if count else "cpu"
    devices = args.devices.split(",")
    if not all(d == "cpu" or d.isdigit() for d in devices):
        raise SystemExit(f"interleave: --devices takes CUDA device numbers or cpu, got {args.devices!r}")
    gpus = [d for d in devices if d != "cpu"]
    if len(set(gpus)) != len(gpus):  # two runs at once on one GPU would time each other
        raise SystemExit(f"interleave: --devices names a GPU twice: {args.devices!r}")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"interleave: --out {args.out} is not empty")

    trees_dir = Path(tempfile.mkdtemp(prefix="interleave-"))
    try:
        base = args.base_tree.resolve() if args.base_tree else export_commit(args.base, trees_dir)
        trees = {"head": args.head_tree.resolve(), "base": base}
        for side, tree in trees.items():
            if not (tree / "benchmarks" / benchmark[0]).is_file():
                raise SystemExit(f"interleave: the {side} tree {tree} has no benchmarks/{benchmark[0]}")
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out.resolve()
        plan = plan_runs(devices, args.runs, out)
        deadline = time.monotonic() + args.budget
        threads = [threading.Thread(target=run_device,
                                    args=(runs, trees, benchmark, deadline, args.min_seconds, trees_dir / "triton"))
                   for runs in plan]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        shutil.rmtree(trees_dir, ignore_errors=True)
    runs = [run for device_runs in plan for run in device_runs]
    columns, rows = read_rows(runs, args.csv)
    table = compare(rows, args.key.split(","), args.metrics.split(","))
    command = "python benchmarks/interleave.py " + " ".join(argv)
    write(out, columns, rows, table, runs, command)
    print((out / "interleave.md").read_text())
    failed = [run.name for run in runs if run.returncode not in (0, None)]
    if failed:
        print(f"interleave: runs that failed or ran out of the budget (logs in {out}): {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
