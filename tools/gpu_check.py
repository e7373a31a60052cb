"""`make gpu-check`: what only a GPU can check, in one command on a GPU machine, written down as one table.

CI has no GPU, so a change to diffulex_backend/, kernels/ or model_repository/ runs this on a GPU machine before it
is submitted. It needs the runtime that `tools/pack_gpu_runtime.py pack` builds on a machine with a network (the
tritonserver, numpy 1.26 for the stub, tritonclient's gRPC client); it installs it here first, unless it already is.
Then it runs, each as a pytest process of its own with the runtime's Python:
  * the kernels, CUDA graphs and fused forward against their references (tests/kernels and the MoE fused forward);
  * the offline API on the GPU (the demo model's answers, the warm start);
  * every family and every decoding strategy served through a real tritonserver on the GPU, with config.pbtxt's
    defaults and with a KIND_GPU instance, a LoRA adapter and page retention among them, token-equal to the
    in-process engine at batch 1; and the shipped model_repository as `make serve` runs it;
  * the server and client suites whose models run on the GPU: the served model's contract, its threads' deaths,
    data parallelism on KIND_GPU instances, page retention, integers at their limits, the client and CLI.
A section passes when pytest passes and skips nothing: a test skipped here is a test the GPU never ran. To keep the
check within one ten-minute command, these run on CI's CPU only: request parsing and the engine loop in process
(no device work), tensor parallelism over gloo (CPU ranks), stub death and shutdown, and the load tests (soak, fuzz,
hostile requests, perf_analyzer, genai-perf).

    python3 tools/gpu_check.py [--runtime .gpu-runtime] [--out DIR] [--commit SHA]

The table goes to docs/gpu-check.md (and OUT/gpu-check.md), with the commit it ran at: git's HEAD, or --commit
where the checkout has no .git.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PREFIX = Path(tempfile.gettempdir()) / "diffulex-gpu-runtime"
# One kernel cache for every section and every stub: a kernel compiles once per check.
KERNEL_CACHE = Path(tempfile.gettempdir()) / "diffulex-gpu-check" / "triton"
TIME_LIMIT_S = 570  # the whole check fits one ten-minute command


@dataclass(frozen=True)
class Section:
    name: str
    paths: tuple[str, ...]
    pytest_args: tuple[str, ...] = ()


# The served path first: it is what users run, and what no other check covers.
SECTIONS = (
    Section("served: every family and strategy, KIND_GPU, the shipped repository",
            ("tests/server/test_served_families.py", "tests/server/test_shipped_repository.py")),
    # Eight workers: the kernel tests compile hundreds of variants, each on a core of its own.
    Section("kernels, CUDA graphs and the fused forward", ("tests/kernels", "tests/unit/test_moe_fused_forward.py"),
            ("-n", "8")),
    Section("offline API", ("tests/unit/test_demo_model.py", "tests/unit/test_offline_warm_up.py")),
    # One process and one session server, in order: a model here sizes its KV cache from the free GPU memory.
    Section("served: server and client suites, on the GPU", (
        *(f"tests/server/{name}" for name in (
            "test_triton_server.py", "test_thread_death.py", "test_data_parallel.py", "test_page_retention_served.py",
            "test_integer_limits.py", "test_served_logprobs.py")),
        "tests/client/test_client.py", "tests/client/test_cli.py")),
)


@dataclass(frozen=True)
class Outcome:
    section: Section
    tests: int
    failed: int
    skipped: int
    returncode: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and self.tests > 0 and self.failed == 0 and self.skipped == 0


def install_runtime(runtime: Path, prefix: Path) -> Path:
    python = prefix / "bin" / "python"
    if not (python.exists() and (prefix / "bin" / "tritonserver").exists()):
        subprocess.run([sys.executable, str(REPOSITORY_ROOT / "tools" / "pack_gpu_runtime.py"), "install",
                        "--runtime", str(runtime), "--prefix", str(prefix)], check=True)
    return python


def run_section(python: Path, section: Section, log_dir: Path, deadline: float) -> Outcome:
    slug = "".join(c if c.isalnum() else "-" for c in section.name)[:40]
    junit = Path(tempfile.mkdtemp(prefix="gpu-check-")) / f"{slug}.xml"
    started = time.monotonic()
    with open(log_dir / f"{slug}.log", "w") as log:
        # A session of its own, so that a section cut off at the deadline takes its tritonservers with it.
        process = subprocess.Popen(
            [str(python), "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
             *section.pytest_args, *section.paths], cwd=REPOSITORY_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(KERNEL_CACHE),
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(KERNEL_CACHE.with_name("flash-attn"))})
        try:
            returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.write("\ncut off at the check's time limit\n")
            returncode = -1
    seconds = time.monotonic() - started
    tests = failed = skipped = 0
    if junit.exists():
        for suite in ElementTree.parse(junit).getroot().iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    return Outcome(section, tests, failed, skipped, returncode, seconds)


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


def table(outcomes: list[Outcome], commit: str, device: str) -> str:
    lines = [
        "# GPU check",
        "",
        f"`make gpu-check` (tools/gpu_check.py) at commit {commit}, on {device}, "
        f"{datetime.date.today().isoformat()}. A section passes when pytest passes and skips nothing.",
        "",
        "| what ran | tests | failed | skipped | result | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for out in outcomes:
        paths = ", ".join(f"`{path}`" for path in out.section.paths)
        lines.append(f"| {out.section.name} ({paths}) | {out.tests} | {out.failed} | {out.skipped} | "
                     f"{'pass' if out.passed else 'FAIL'} | {out.seconds:.0f} |")
    total = sum(out.seconds for out in outcomes)
    verdict = "pass" if outcomes and all(out.passed for out in outcomes) else "FAIL"
    lines += [f"| all | {sum(o.tests for o in outcomes)} | {sum(o.failed for o in outcomes)} | "
              f"{sum(o.skipped for o in outcomes)} | {verdict} | {total:.0f} |", ""]
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
    args = parser.parse_args(argv)
    python = install_runtime(args.runtime, args.prefix)
    log_dir = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_limit
    outcomes = []
    for section in SECTIONS:
        if args.only and not any(text in section.name for text in args.only):
            continue
        outcome = run_section(python, section, log_dir, deadline)
        outcomes.append(outcome)
        print(f"{'pass' if outcome.passed else 'FAIL'}  {outcome.seconds:5.0f} s  {outcome.tests} tests, "
              f"{outcome.failed} failed, {outcome.skipped} skipped  {section.name}", flush=True)
    report = table(outcomes, commit_of(args.commit), device_line(python))
    (REPOSITORY_ROOT / "docs" / "gpu-check.md").write_text(report)
    (log_dir / "gpu-check.md").write_text(report)
    print(report)
    return 0 if all(out.passed for out in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
