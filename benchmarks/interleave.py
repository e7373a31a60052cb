"""One benchmark over two versions of the project, their processes interleaved, to see a change smaller than what
separates two runs of one version.

Two processes of the same code on one machine differ by up to several percent (docs/performance.md), so a change
timed once against one run of its base says nothing below that. Here each device runs the two versions in turn,
head, base, base, head, head, base, ... (so that a drift along the runs, such as a GPU warming, weighs on both
alike), and the next device starts with the base; a difference shows when the two versions' runs fall apart.

    python benchmarks/interleave.py --out DIR --base 4dc8b65 --runs 4 --devices 0,1 -- \\
        forward.py --models llada2-mini --sections forward --quantization none,fp8 --batches 1 --contexts 512

The head is this checkout as it is when the command starts (its tracked files and the untracked ones git does not
ignore, copied), or --head-tree; the base a commit that `git archive` exports, or --base-tree (a tree exported
already, for a machine without the repository's history). Each process runs the benchmark, a script of
benchmarks/, from its tree's benchmarks/ with PYTHONPATH at the tree, in a process group of its own, on its device
(CUDA_VISIBLE_DEVICES, counted within the GPUs this process sees; `cpu` hides every GPU and runs the kernels under
Triton's interpreter), with a Triton cache of its tree and device, an --out of its own, and the time left of
--budget seconds. An interrupt (Ctrl-C, SIGTERM) stops the runs under way and tabulates those that finished.

Then, over the runs that exited 0:
  * interleave.csv: every row of every run's --csv (forward.csv by default), after the run's name, device, order
    and side;
  * interleave_compare.csv and interleave.md: for each row (its --key columns) and each --metrics column, both
    sides' values in run order, their means, the base's mean over the head's, whether the two sides' runs fall
    apart (every run of one below every run of the other), and how often they would by chance alone: two sides of
    n and m runs of one version fall apart with probability 2 / C(n + m, n), 1/3 at 2 and 2, 1/35 at 4 and 4. Many
    rows and metrics make some fall apart by chance; a change shows where a row's runs fall apart at a small chance
    and its neighbours' do too.
The --key columns must name one row of a run's CSV; a key or metric column that no CSV has is refused.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import shutil
import signal
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
RUN_COLUMNS = ("interleave_run", "interleave_device", "interleave_order", "interleave_side")
COMPARE_COLUMNS = ("metric", "head", "base", "head_mean", "base_mean", "base_over_head", "apart", "chance_apart")


@dataclass
class Run:
    slot: int  # the device's place in --devices
    device: str  # a CUDA device number among those visible, or cpu
    order: int  # 1, 2, ... on its device
    side: str  # "head" or "base"
    out: Path
    outcome: str = "skipped: the budget was spent"  # or "exit N", "ran out of the budget", "stopped", "failed: ..."

    @property
    def name(self) -> str:
        return f"d{self.slot}-{self.device}-{self.order}-{self.side}"

    @property
    def ok(self) -> bool:
        return self.outcome == "exit 0"


def plan_runs(devices: list[str], runs: int, out: Path) -> list[list[Run]]:
    """Each device's runs in its order: head, base, base, head, head, ... (ABBA, which a linear drift along the
    runs weighs on both sides alike), the odd devices starting with the base."""
    return [[Run(k, device, i + 1, SIDES[((i + 1) // 2 + k) % 2], out) for i in range(runs)]
            for k, device in enumerate(devices)]


def chance_apart(n: int, m: int) -> float:
    """The probability that n runs of one side and m of the other, all of one version, fall apart by chance."""
    return min(1.0, 2 / math.comb(n + m, n)) if n and m else 1.0


class Interleaver:
    """Runs each device's plan on a thread of its own; `stop` ends every run under way and starts no other."""

    def __init__(self, trees: dict[str, Path], benchmark: list[str], deadline: float, min_seconds: float,
                 caches: Path):
        self.trees, self.benchmark, self.deadline, self.min_seconds, self.caches = (
            trees, benchmark, deadline, min_seconds, caches)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()

    def run_all(self, plan: list[list[Run]]) -> None:
        threads = [threading.Thread(target=self.run_device, args=(runs,), daemon=True) for runs in plan]
        for thread in threads:
            thread.start()
        try:
            # Sleeps, not joins, between looks: a signal that interrupts Thread.join can leave that thread looking
            # ended while it runs on.
            while any(thread.is_alive() for thread in threads):
                time.sleep(0.2)
        finally:
            self.stop()
            for thread in threads:
                thread.join()

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            for process in self.live:
                kill_group(process)

    def run_device(self, runs: list[Run]) -> None:
        for run in runs:
            left = self.deadline - time.monotonic()
            if self.stopping.is_set() or left < self.min_seconds:
                if self.stopping.is_set():
                    run.outcome = "stopped before it started"
                continue
            try:
                run.outcome = self.run_one(run, left)
            except Exception as error:  # noqa: BLE001  (one run's failure is recorded, and the others go on)
                run.outcome = f"failed: {type(error).__name__}: {error}"

    def run_one(self, run: Run, left: float) -> str:
        tree = self.trees[run.side]
        env = dict(os.environ, PYTHONPATH=str(tree), TRITON_CACHE_DIR=str(self.caches / f"{run.side}-{run.device}"))
        if run.device == "cpu":  # no GPU: the kernels run under Triton's interpreter, as CI runs them
            env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        else:
            env["CUDA_VISIBLE_DEVICES"] = run.device
            env.pop("TRITON_INTERPRET", None)
        out = run.out / run.name
        out.mkdir(parents=True)
        with open(run.out / f"{run.name}.log", "w") as log:
            # A group of its own, so that a timeout or a stop ends whatever the benchmark started too.
            process = subprocess.Popen([sys.executable, *self.benchmark, "--out", str(out)], cwd=tree / "benchmarks",
                                       env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            with self.lock:
                self.live.add(process)
            try:
                process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                kill_group(process)
                process.wait()
                print(f"ran out of the budget after {left:.0f} s", file=log)
                return "ran out of the budget"
            finally:
                with self.lock:
                    self.live.discard(process)
        return "stopped" if self.stopping.is_set() and process.returncode != 0 else f"exit {process.returncode}"


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def git(*args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    except OSError as error:
        raise SystemExit(f"interleave: git cannot run here ({error}); give --base-tree and --head-tree") from error
    if done.returncode != 0:
        raise SystemExit(f"interleave: git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def export_commit(commit: str, into: Path) -> Path:
    """The tree of `commit` in this repository, written at `into`."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True)
    except OSError as error:
        raise SystemExit(f"interleave: git cannot run here ({error}); give --base-tree") from error
    if archive.returncode != 0:
        raise SystemExit(f"interleave: --base {commit!r} is not a commit git can export here: "
                         f"{archive.stderr.decode(errors='replace').strip()}")
    into.mkdir(parents=True)
    with tempfile.TemporaryFile() as tar_file:
        tar_file.write(archive.stdout)
        tar_file.seek(0)
        with tarfile.open(fileobj=tar_file) as tar:
            tar.extractall(into, filter="tar")
    return into


def copy_checkout(into: Path) -> Path:
    """This checkout as it is now, the files git tracks and those it does not ignore, so that an edit or a commit
    during the runs does not reach them."""
    for name in git("ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0"):
        source = REPO / name
        if not name or not (source.exists() or source.is_symlink()):  # a tracked file deleted in the checkout
            continue
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return into


def describe_head() -> str:
    commit = git("rev-parse", "--short", "HEAD").strip()
    changed = git("status", "--porcelain", "--untracked-files=normal").strip()
    return f"{commit}, with uncommitted changes" if changed else commit


def read_rows(runs: list[Run], csv_name: str, key: list[str], metrics: list[str]) -> tuple[list[str], list[dict]]:
    """Every row of the CSVs of the runs that exited 0, after the run's name, device, order and side; the CSVs'
    own columns. Raises SystemExit when a CSV takes a column of the run's name, a key repeats in one run, or a key
    or metric column is in no CSV."""
    columns: list[str] = []
    rows = []
    for run in runs:
        path = run.out / run.name / csv_name
        if not run.ok:
            continue
        if not path.exists():
            run.outcome = f"exit 0, without {csv_name}"
            continue
        with open(path, newline="") as f:
            reader = csv.DictReader(f, restkey="interleave_extra")
            clash = set(reader.fieldnames or []) & set(RUN_COLUMNS)
            if clash:
                raise SystemExit(f"interleave: {path} has columns named as the tool's own: {sorted(clash)}")
            columns += [c for c in reader.fieldnames or [] if c not in columns]
            seen = set()
            for row in reader:
                row.pop("interleave_extra", None)
                names = tuple(row.get(k) for k in key)
                if names in seen:
                    raise SystemExit(f"interleave: the --key columns {key} name more than one row of {path}: {names}")
                seen.add(names)
                rows.append(dict(zip(RUN_COLUMNS, (run.name, run.device, run.order, run.side)), **row))
    missing = [c for c in [*key, *metrics] if rows and c not in columns]
    if missing:
        raise SystemExit(f"interleave: no {csv_name} has the columns {missing}; it has {columns}")
    return columns, rows


def compare(rows: list[dict], key: list[str], metrics: list[str]) -> list[dict]:
    """Per row key and metric: each side's values in run order (device by device), their means, base over head,
    whether every run of one side is below every run of the other, and the chance of that with no change."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for row in rows:
        for metric in metrics:
            try:
                value = float(row.get(metric) or "nan")
            except ValueError:  # not a number: no measurement
                continue
            if value == value:  # NaN or an empty cell is no measurement
                sides = groups.setdefault((*(row.get(k, "") for k in key), metric), {s: [] for s in SIDES})
                sides[row["interleave_side"]].append(value)
    table = []
    for (*names, metric), sides in groups.items():
        head, base = sides["head"], sides["base"]
        entry = dict(zip(key, names))
        entry.update(metric=metric, head=", ".join(f"{v:.4g}" for v in head),
                     base=", ".join(f"{v:.4g}" for v in base), head_mean="", base_mean="", base_over_head="",
                     apart="", chance_apart="")
        if head and base:
            head_mean, base_mean = statistics.mean(head), statistics.mean(base)
            entry.update(head_mean=f"{head_mean:.4g}", base_mean=f"{base_mean:.4g}",
                         base_over_head=f"{base_mean / head_mean:.4g}" if head_mean else "",
                         apart="yes" if max(head) < min(base) or max(base) < min(head) else "no",
                         chance_apart=f"{chance_apart(len(head), len(base)):.3g}")
        table.append(entry)
    return table


def write(out: Path, columns: list[str], rows: list[dict], key: list[str], table: list[dict], runs: list[Run],
          header: list[str]) -> None:
    with open(out / "interleave.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, [*RUN_COLUMNS, *columns])
        writer.writeheader()
        writer.writerows(rows)
    fields = [*key, *COMPARE_COLUMNS]
    with open(out / "interleave_compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(table)
    lines = [*header, ""] + [f"- {run.name}: {run.outcome}" for run in runs]
    if table:
        cell = lambda value: str(value).replace("|", "\\|")  # noqa: E731
        lines += ["", "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
        lines += ["| " + " | ".join(cell(entry[f]) for f in fields) + " |" for entry in table]
    (out / "interleave.md").write_text("\n".join(lines) + "\n")


def parse_devices(text: str) -> list[str]:
    """--devices as CUDA_VISIBLE_DEVICES values: each number counts within the GPUs this process sees (its own
    CUDA_VISIBLE_DEVICES, when set), or `cpu`."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or None
    devices = []
    for item in text.split(","):
        if item == "cpu":
            devices.append(item)
            continue
        if not item.isdigit():
            raise SystemExit(f"interleave: --devices takes GPU numbers or cpu, got {text!r}")
        index = int(item)
        if visible is not None and index >= len(visible):
            raise SystemExit(f"interleave: --devices names GPU {index}, but this process sees {len(visible)} "
                             f"(CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})")
        devices.append(visible[index] if visible is not None else str(index))
    if len(set(devices)) != len(devices):  # two runs at once on one device would time each other
        raise SystemExit(f"interleave: --devices names a device twice: {text!r}")
    if "cpu" in devices and len(devices) > 1:  # the host's cores would time the GPUs' launches
        raise SystemExit(f"interleave: --devices mixes cpu with GPUs: {text!r}")
    return devices


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
    parser.add_argument("--head-tree", type=Path, help="the head (default: a copy of this checkout as it is)")
    parser.add_argument("--runs", type=int, default=4, help="runs on each device, the sides in turn")
    parser.add_argument("--devices", help="comma-separated GPU numbers, or cpu (default: every GPU, else cpu)")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds for every run together")
    parser.add_argument("--min-seconds", type=float, default=60.0, help="a run starts only with this much budget left")
    parser.add_argument("--csv", default="forward.csv", help="the benchmark's CSV under its --out")
    parser.add_argument("--key", default="section,model,case", help="the CSV's columns that name a row")
    parser.add_argument("--metrics", default="engine_ms,engine_step_ms", help="the CSV's columns to compare")
    args = parser.parse_args(own)
    script = benchmark[0] if benchmark else ""
    if not script.endswith(".py") or "/" in script or os.sep in script:
        raise SystemExit(f"interleave: the benchmark after `--` is a script of benchmarks/ by its name, got {script!r}")
    if any(arg == "--out" or arg.startswith("--out=") for arg in benchmark):
        raise SystemExit("interleave: each run gets an --out of its own; give the benchmark none")
    if not (0 < args.budget < float("inf") and 0 <= args.min_seconds < float("inf")):
        raise SystemExit(f"interleave: --budget must be a positive number of seconds and --min-seconds one not "
                         f"below 0, got {args.budget} and {args.min_seconds}")
    key, metrics = args.key.split(","), args.metrics.split(",")
    clash = set(key) & set(COMPARE_COLUMNS)
    if clash:
        raise SystemExit(f"interleave: --key {sorted(clash)} would collide with the comparison's own columns")
    if args.devices is None:
        import torch

        count = torch.cuda.device_count()
        args.devices = ",".join(map(str, range(count))) if count else "cpu"
    devices = parse_devices(args.devices)
    if args.runs < 1:
        raise SystemExit(f"interleave: --runs must be at least 1, got {args.runs}")
    counts = {side: sum(run.side == side for runs in plan_runs(devices, args.runs, Path()) for run in runs)
              for side in SIDES}
    if min(counts.values()) < 2:
        raise SystemExit(f"interleave: --runs {args.runs} on {len(devices)} device(s) gives {counts['head']} run(s) "
                         f"of the head and {counts['base']} of the base; a comparison needs at least 2 of each")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise SystemExit(f"interleave: --out {args.out} is not an empty folder")

    trees_dir = Path(tempfile.mkdtemp(prefix="interleave-"))
    interrupted = False
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops as Ctrl-C does
    try:
        base = args.base_tree.resolve() if args.base_tree else export_commit(args.base, trees_dir / "base")
        head = args.head_tree.resolve() if args.head_tree else copy_checkout(trees_dir / "head")
        trees = {"head": head, "base": base}
        for side, tree in trees.items():
            if not (tree / "benchmarks" / script).is_file():
                raise SystemExit(f"interleave: the {side} tree {tree} has no benchmarks/{script}")
        header = [f"`{shlex.join(['python', 'benchmarks/interleave.py', *argv])}`", "",
                  f"- head: {args.head_tree or describe_head()}",
                  f"- base: {args.base_tree or git('rev-parse', '--short', args.base).strip()}"]
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out.resolve()
        plan = plan_runs(devices, args.runs, out)
        interleaver = Interleaver(trees, benchmark, time.monotonic() + args.budget, args.min_seconds,
                                  trees_dir / "triton")
        try:
            interleaver.run_all(plan)
        except KeyboardInterrupt:
            interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(trees_dir, ignore_errors=True)
    runs = [run for device_runs in plan for run in device_runs]
    columns, rows = read_rows(runs, args.csv, key, metrics)
    table = compare(rows, key, metrics)
    write(out, columns, rows, key, table, runs, header)
    print((out / "interleave.md").read_text())
    failed = [run.name for run in runs if not run.ok]
    if failed:
        print(f"interleave: runs that did not exit 0 (logs in {out}): {', '.join(failed)}", file=sys.stderr)
    compared = any(entry["apart"] for entry in table)
    if not compared:
        print("interleave: no row has a metric measured on both sides", file=sys.stderr)
    return 1 if failed or interrupted or not compared else 0


if __name__ == "__main__":
    sys.exit(main())
