"""`make gpu-check`: what only a GPU can check, in one command on a GPU machine, written down as one table.

CI has no GPU, so a change to diffulex_backend/, kernels/ or model_repository/ runs this on a GPU machine before it
is submitted. It needs the runtime that `tools/pack_gpu_runtime.py pack` builds on a machine with a network (the
tritonserver, numpy 1.26 for the stub, tritonclient's gRPC client); it installs it here first, unless it already is.
Then it runs, each as a pytest process of its own with the runtime's Python:
  * the kernels, CUDA graphs and fused forward against their references (tests/kernels and the MoE fused forward);
  * the offline API on the GPU (the demo model's answers, the warm start, the KV pool within gpu_memory_utilization);
  * every family and every decoding strategy served through a real tritonserver on the GPU, with config.pbtxt's
    defaults and with a KIND_GPU instance, a LoRA adapter and page retention among them, token-equal to the
    in-process engine at batch 1; and the shipped model_repository as `make serve` runs it;
  * the server and client suites whose models run on the GPU: the served model's contract, its threads' deaths,
    data parallelism on KIND_GPU instances, page retention, integers at their limits, the client and CLI;
  * on a machine of two GPUs or more, tensor parallelism served through tritonserver, one rank on each of two GPUs
    over NCCL (on one GPU the table says it did not run).
A section passes when pytest passes and skips nothing: a test skipped here is a test the GPU never ran. To keep the
check within its time limit, these run on CI's CPU only: request parsing and the engine loop in process
(no device work), tensor parallelism over gloo (CPU ranks), stub death and shutdown, and the load tests (soak, fuzz,
hostile requests, perf_analyzer, genai-perf).
On a machine of several GPUs the sections are shared out, longest first, and the GPUs run their shares at once,
each section in a process that sees its GPU alone; each section's `seconds` is about what it took on two H200s
sharing them. One after another the four take about 850 s on one H200 (docs/gpu-check.md), more than the time
limit allows: on one GPU they run as two or three commands of a few sections each (--only). A section that needs
two GPUs runs after the shares, seeing the first two.

    python3 tools/gpu_check.py [--runtime .gpu-runtime] [--out DIR] [--commit SHA] [--gpus N]

The table goes to docs/gpu-check.md (and OUT/gpu-check.md), with the commit it ran at: git's HEAD, or --commit
where the checkout has no .git.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PREFIX = Path(tempfile.gettempdir()) / "diffulex-gpu-runtime"
# One kernel cache for every section and every stub: a kernel compiles once per check.
KERNEL_CACHE = Path(tempfile.gettempdir()) / "diffulex-gpu-check" / "triton"
TIME_LIMIT_S = 570  # seconds for every section together, unless --time-limit says otherwise


@dataclass(frozen=True)
class Section:
    name: str
    paths: tuple[str, ...]
    pytest_args: tuple[str, ...] = ()
    seconds: int = 60  # what it took on an H200, kernels compiled afresh (docs/gpu-check.md): for sharing out GPUs
    gpus: int = 1  # GPUs it needs at once; a section of several runs after the shared ones, on the first GPUs


TWO_GPU_KERNEL_TESTS = "tests/kernels/test_peer_collectives_two_gpus.py"

# The served path first: it is what users run, and what no other check covers.
SECTIONS = (
    Section("served: every family and strategy, KIND_GPU, the shipped repository",
            ("tests/server/test_served_families.py", "tests/server/test_shipped_repository.py"), seconds=185),
    # Eight workers: the kernel tests compile hundreds of variants, each on a core of its own.
    Section("kernels, CUDA graphs and the fused forward", ("tests/kernels", "tests/unit/test_moe_fused_forward.py"),
            ("-n", "8", f"--ignore={TWO_GPU_KERNEL_TESTS}"), seconds=238),
    # Profiling records CUDA on a GPU only, and must leave the engine's graphs and speed as they were.
    # gpu_memory_utilization's share is the device's: the sizing test needs the GPU to itself.
    Section("offline API", ("tests/unit/test_demo_model.py", "tests/unit/test_offline_warm_up.py",
                            "tests/unit/test_profiling.py", "tests/unit/test_offline_kv_sizing.py"), seconds=70),
    # One process and one session server, in order: a model here sizes its KV cache from the free GPU memory.
    Section("served: server and client suites, on the GPU", (
        *(f"tests/server/{name}" for name in (
            "test_triton_server.py", "test_thread_death.py", "test_data_parallel.py", "test_page_retention_served.py",
            "test_integer_limits.py", "test_served_logprobs.py", "test_profiling_served.py")),
        "tests/client/test_client.py", "tests/client/test_cli.py"), seconds=339),
    Section("tensor parallelism, one rank on each of two GPUs: the collectives over peer memory, then served",
            (TWO_GPU_KERNEL_TESTS, "tests/server/test_tensor_parallel_gpu.py"), seconds=58, gpus=2),
)


def share_out(sections: list[Section], num_gpus: int) -> list[list[Section]]:
    """The sections each GPU runs, in SECTIONS' order on each: the longest first to the GPU with the least so far,
    so that the check ends about when its longest share does."""
    shares: list[list[Section]] = [[] for _ in range(max(1, min(num_gpus, len(sections))))]
    for section in sorted(sections, key=lambda section: -section.seconds):
        min(shares, key=lambda share: sum(s.seconds for s in share)).append(section)
    return [sorted(share, key=sections.index) for share in shares if share]


@dataclass(frozen=True)
class Outcome:
    section: Section
    tests: int
    failed: int
    skipped: int
    returncode: int
    seconds: float
    not_run: str = ""  # why the section did not run (too few GPUs here); it then counts neither way
    cut: bool = False  # stopped at the check's time limit: its counts are of the tests that had ended by then

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and self.tests > 0 and self.failed == 0 and self.skipped == 0

    @property
    def result(self) -> str:
        if self.not_run:
            return f"not run: {self.not_run}"
        return "FAIL: cut at the time limit" if self.cut else "pass" if self.passed else "FAIL"


# pytest -v's line for a test that ended, with or without xdist's worker prefix.
VERBOSE_OUTCOME = re.compile(r"(?:^\S+::\S+.* |^\[gw\d+\] .*)(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def counts_from_log(log: str) -> tuple[int, int, int]:
    """(tests, failed, skipped) from pytest -v's lines of the tests that ended: a section cut at the time limit
    writes no junit report, and its table row still says how far it got."""
    outcomes = [match.group(1) for match in map(VERBOSE_OUTCOME.search, log.splitlines()) if match]
    return len(outcomes), sum(o in ("FAILED", "ERROR") for o in outcomes), outcomes.count("SKIPPED")


def install_runtime(runtime: Path, prefix: Path) -> Path:
    python = prefix / "bin" / "python"
    if not (python.exists() and (prefix / "bin" / "tritonserver").exists()):
        subprocess.run([sys.executable, str(REPOSITORY_ROOT / "tools" / "pack_gpu_runtime.py"), "install",
                        "--runtime", str(runtime), "--prefix", str(prefix)], check=True)
    return python


def run_section(python: Path, section: Section, log_dir: Path, deadline: float, gpu: str | None = None) -> Outcome:
    slug = "".join(c if c.isalnum() else "-" for c in section.name)[:40]
    junit = Path(tempfile.mkdtemp(prefix="gpu-check-")) / f"{slug}.xml"
    started = time.monotonic()
    with open(log_dir / f"{slug}.log", "w") as log:
        # A session of its own, so that a section cut off at the deadline takes its tritonservers with it.
        process = subprocess.Popen(
            [str(python), "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
             *section.pytest_args, *section.paths], cwd=REPOSITORY_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(KERNEL_CACHE),
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(KERNEL_CACHE.with_name("flash-attn")),
                 **({} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})})
        try:
            returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.write("\ncut off at the check's time limit\n")
            returncode = -1
    seconds = time.monotonic() - started
    if returncode == -1:
        return Outcome(section, *counts_from_log((log_dir / f"{slug}.log").read_text()), returncode, seconds, cut=True)
    tests = failed = skipped = 0
    if junit.exists():
        for suite in ElementTree.parse(junit).getroot().iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    return Outcome(section, tests, failed, skipped, returncode, seconds)


def run_share(python: Path, share: list[Section], log_dir: Path, deadline: float, gpu: str | None) -> list[Outcome]:
    outcomes = []
    for section in share:
        outcome = run_section(python, section, log_dir, deadline, gpu)
        outcomes.append(outcome)
        print(f"{outcome.result}  {outcome.seconds:5.0f} s  {outcome.tests} tests, "
              f"{outcome.failed} failed, {outcome.skipped} skipped  {section.name}"
              + ("" if gpu is None else f"  (GPU {gpu})"), flush=True)
    return outcomes


def visible_gpus(python: Path) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them for a child (all of them when unset)."""
    found = subprocess.run([str(python), "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                           text=True, check=False)
    count = int(found.stdout.strip() or 0)
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    return named.split(",")[:count] if named else [str(index) for index in range(count)]


def device_line(python: Path) -> str:
    return subprocess.run([str(python), "-c", (
        "import torch, triton; print(f'{torch.cuda.get_device_name()} (torch {torch.__version__}, "
        "triton {triton.__version__})')")], capture_output=True, text=True, check=False).stdout.strip() or "no GPU"


def commit_of(given: str | None) -> str:
    if given:
        return given
    found = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPOSITORY_ROOT, capture_output=True,
                           text=True, check=False)
    return found.stdout.strip() or "unknown"


def table(outcomes: list[Outcome], commit: str, device: str, num_gpus: int, seconds: float) -> str:
    """The check's table; its last row's seconds are the whole check's, from its start to its last section's end."""
    shared = f", {num_gpus} of them sharing the sections out" if num_gpus > 1 else ""
    lines = [
        "# GPU check",
        "",
        f"`make gpu-check` (tools/gpu_check.py) at commit {commit}, on {device}{shared}, "
        f"{datetime.date.today().isoformat()}. A section passes when pytest passes and skips nothing.",
        "",
        "| what ran | tests | failed | skipped | result | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for out in outcomes:
        paths = ", ".join(f"`{path}`" for path in out.section.paths)
        lines.append(f"| {out.section.name} ({paths}) | {out.tests} | {out.failed} | {out.skipped} | "
                     f"{out.result} | {out.seconds:.0f} |")
    ran = [out for out in outcomes if not out.not_run]
    verdict = "pass" if ran and all(out.passed for out in ran) else "FAIL"
    if len(ran) < len(outcomes):
        verdict += f" ({len(outcomes) - len(ran)} not run)"
    lines += [f"| all | {sum(o.tests for o in outcomes)} | {sum(o.failed for o in outcomes)} | "
              f"{sum(o.skipped for o in outcomes)} | {verdict} | {seconds:.0f} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", type=Path, default=REPOSITORY_ROOT / ".gpu-runtime")
    parser.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    parser.add_argument("--out", type=Path, help="also write the table and each section's log here")
    parser.add_argument("--commit", help="the commit checked, where the checkout has no .git")
    parser.add_argument("--only", action="append", help="run only the sections whose name holds this text "
                        "(repeatable)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds for all the sections")
    parser.add_argument("--gpus", default="all", help="how many of the visible GPUs share the sections out, each "
                        "running its share in turn (default: all of them); 1 runs them one after another")
    args = parser.parse_args(argv)
    python = install_runtime(args.runtime, args.prefix)
    log_dir = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.time_limit
    chosen = [section for section in SECTIONS if not args.only or any(text in section.name for text in args.only)]
    if not chosen:
        parser.error(f"--only {args.only} names no section")
    gpus = visible_gpus(python)
    by_section = {}
    shares = share_out([section for section in chosen if section.gpus == 1],
                       len(gpus) if args.gpus == "all" else min(int(args.gpus), len(gpus)))
    if shares:
        # Each GPU runs its share in a thread of its own; the sections themselves are processes.
        with ThreadPoolExecutor(len(shares)) as pool:
            finished = pool.map(lambda index: run_share(python, shares[index], log_dir, deadline,
                                                        gpus[index] if len(shares) > 1 else None), range(len(shares)))
            by_section = {outcome.section: outcome for share in finished for outcome in share}
    for section in chosen:
        if section.gpus == 1:
            continue
        if len(gpus) < section.gpus:
            by_section[section] = Outcome(section, 0, 0, 0, 0, 0.0,
                                          not_run=f"needs {section.gpus} GPUs, {len(gpus)} here")
            print(f"{by_section[section].result}  {section.name}", flush=True)
        else:
            by_section[section], = run_share(python, [section], log_dir, deadline, ",".join(gpus[:section.gpus]))
    outcomes = [by_section[section] for section in chosen]
    report = table(outcomes, commit_of(args.commit), device_line(python), max(1, len(shares)),
                   time.monotonic() - started)
    (REPOSITORY_ROOT / "docs" / "gpu-check.md").write_text(report)
    (log_dir / "gpu-check.md").write_text(report)
    print(report)
    return 0 if all(out.passed for out in outcomes if not out.not_run) else 1


if __name__ == "__main__":
    sys.exit(main())
