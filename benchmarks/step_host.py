"""The host's work at the head of a runner step, inside back-to-back steps and alone.

A batch-1 step leaves the device idle while the host builds the next batch and calls the forward: the batch's build
is timed inside the step and alone, with the device idle, and the two differ by more than the step's own work
explains. This script times, over a random model at a released shape (one block per request over a cached context,
as forward.py's forward section), the host time of `build_batch`, of its pinned buffer (`host_buffer`) and of the
forward's call (its input copy and graph replay queued), each the median over the steps of a run of
`runner.execute` back to back, in these settings, taken in turn for several rounds:

  - as the engine runs;
  - with Python's garbage collector off;
  - with the batch built twice a step, the second build timed: the same work once the host has just run it;
  - with the batch's pinned buffer kept from step to step, zeroed, in place of a new one from torch's caching host
    allocator.

Beside them, `build_batch` and `host_buffer` alone, each call after the device has finished, and the step's wall
time in each setting. `host_buffer`'s median is over every call in the steps: the build's, the first build's too
where the batch is built twice, and a graph's padded copy of the batch where its layout is not the bucket's. It
writes step_host.csv and step_host.md to --out.

    python benchmarks/step_host.py --out DIR                          # GPU: LLaDA-8B, fp8 weights, batch 1
    python benchmarks/step_host.py --out DIR --quantization none --batch 8
    python benchmarks/step_host.py --smoke --out DIR                  # anywhere: a tiny model, a few steps
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import pathlib
import statistics
import sys
import tempfile
import time

import torch

import forward as bench
from diffulex_backend import forward_batch
from diffulex_backend.plan import SchedulerOutput
from result_table import ResultTable

FIELDS = ["round", "setting", "step_ms", "build_batch_us", "host_buffer_us", "forward_call_us"]


class HostTimes:
    """Host microseconds per call of the wrapped functions, by name."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            result = fn(*args, **kwargs)
            self.times.setdefault(name, []).append(1e6 * (time.perf_counter() - began))
            return result
        return timed

    def median(self, name: str) -> float:
        return statistics.median(self.times[name]) if name in self.times else float("nan")


@contextlib.contextmanager
def replaced(obj, attr: str, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


@contextlib.contextmanager
def collector_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def kept_buffer():
    """host_buffer that returns one buffer per size, zeroed, for the whole run."""
    kept: dict[int, torch.Tensor] = {}

    def host_buffer(size: int, pin_memory: bool) -> torch.Tensor:
        if size not in kept:
            kept[size] = torch.zeros(size, dtype=torch.int64, pin_memory=pin_memory)
        return kept[size].zero_()
    return host_buffer


def settings(runner, build, times: HostTimes) -> dict:
    """Each setting: a context manager over the run that puts it in place. `build` is the runner's own
    build_batch; runner.build_batch is it timed."""
    timed_build = runner.build_batch

    def built_twice(plans):
        build(plans)
        return timed_build(plans)

    return {
        "as the engine runs": contextlib.nullcontext,
        "garbage collector off": collector_off,
        "batch built twice, the second timed": lambda: replaced(runner, "build_batch", built_twice),
        "pinned buffer kept": lambda: replaced(forward_batch, "host_buffer",
                                               times.wrap("host_buffer", kept_buffer())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--model", default="llada-8b", choices=sorted(bench.RELEASED_SHAPES))
    parser.add_argument("--quantization", default="fp8", choices=["none", "fp8"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60, help="timed steps a setting takes each round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on any device, a few steps")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        torch.set_num_threads(1)
        args.steps, args.rounds, args.context = 3, 1, 64
    shape = dict(bench.SMOKE_SHAPE if args.smoke else bench.RELEASED_SHAPES[args.model])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    plan = bench.SMOKE if args.smoke else bench.FULL
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("step_host", FIELDS)
    with tempfile.TemporaryDirectory() as tmp:
        model, model_dir = bench.build_model(shape, pathlib.Path(tmp) / "model", dtype, device, args.smoke)
        model = bench.quantized(model, args.quantization)
        pages = args.batch * -(-(args.context + bench.BLOCK) // bench.PAGE_SIZE)
        engine = bench.make_engine(model, model_dir, device, plan, max_model_len=args.context + 2 * bench.BLOCK,
                                   max_num_reqs=args.batch, max_num_batched_tokens=max(4096, args.batch * bench.BLOCK),
                                   num_kv_pages=pages)
        bench.fill_cache(engine, seed=1)
        plans = bench.cached_context_plans(engine, args.batch, args.context, torch.Generator().manual_seed(0))
        runner, sched, times = engine.runner, SchedulerOutput(plans=plans), HostTimes()
        build, call, new_buffer = runner.build_batch, runner.forward, forward_batch.host_buffer
        size = build(plans).layout.size
        with torch.inference_mode():
            table.add(round=0, setting="alone, the device idle", step_ms="",
                      build_batch_us=1e3 * bench.host_ms(lambda: build(plans), device, 50),
                      host_buffer_us=1e3 * bench.host_ms(lambda: new_buffer(size, runner.pin_memory), device, 50),
                      forward_call_us="")
            # Timed for the rest of the run, which ends with the process.
            runner.build_batch = times.wrap("build_batch", build)
            runner.forward = times.wrap("forward_call", call)
            forward_batch.host_buffer = times.wrap("host_buffer", new_buffer)
            for round_ in range(1, args.rounds + 1):
                for name, setting in settings(runner, build, times).items():
                    with setting():
                        for _ in range(3):
                            runner.execute(sched)
                        times.times.clear()
                        bench.synchronize(device)
                        began = time.perf_counter()
                        for _ in range(args.steps):
                            runner.execute(sched)
                        bench.synchronize(device)
                        step_ms = 1e3 * (time.perf_counter() - began) / args.steps
                    table.add(round=round_, setting=name, step_ms=step_ms,
                              build_batch_us=times.median("build_batch"),
                              host_buffer_us=times.median("host_buffer"),
                              forward_call_us=times.median("forward_call"))
    table.write(args.out, sys.argv[1:])


if __name__ == "__main__":
    main()
