"""Tensor parallelism against one rank, in one run: the same random-weight checkpoint and the same prompts.

For each model, each dtype in --dtypes and each tensor_parallel_size in --sizes (the first is the baseline), one
engine runs every batch in --batches, with one 32-token block per request decoded under the top-k schedule (one
token per block per step, so random weights cannot change how much a step decodes). Per (size, batch):
  - the greedy outputs against the baseline's: equal, or the first request and position where they differ;
  - the logits of the first decode forward against the baseline's, over the columns rank 0 holds: the largest
    absolute difference, and that over the largest baseline logit. In float32 (TF32 off on every rank) a logic
    error shows as a difference of the logits' own size, rounding as one near 1e-6;
  - ms per decode step (engine.step_deltas, after every prompt's prefill: the served model's step, whose text is
    made on its response thread, so that detokenizing is not counted), the median over the timed steps, timed
    without the profiler, which slows the host;
  - the collectives' ms per step on rank 0 (torch.profiler: NCCL kernels and the one-shot collectives' on GPUs,
    gloo ops on a CPU), and the norm kernel's: over peer memory a row-parallel product's sum ends in its norm, in
    the collective's launch, so that only the two together compare across sizes;
  - the speed-up over the baseline, beside the ideal one (the size ratio: at batch 1 a step streams the weights,
    and each rank streams 1/N of them);
  - the weight-streaming floor of one rank: its share of the model's bytes / the measured HBM bandwidth.
And where rank 0's host time per step goes (tensor_parallel_host.md): scheduling, the plan's broadcast, building
the batch, launching the forward, the sampler's inputs (its rows and their upload), the logits and the sampler, the
step's one read-back (which waits for the device), and the rest: the per-row values built on the host, and the
engine's update after the read-back. And, from the profiled request set (tensor_parallel_ops.md), rank 0's calls
that take the most time per step, on each side:
  - host: torch's operators and the CUDA runtime's calls by their own time, where a call that waits for the device
    (a copy to or from pageable memory, a synchronisation) shows by name. The profiler slows the host, so these
    times are larger than the clock's; what they rank is where a step waits;
  - device: the kernels by their time on the GPU, and all of them together ("all kernels"), so that a step whose
    device is busy for longer than its weights take to stream shows which kernels hold it.
Writes tensor_parallel.csv/.md, tensor_parallel_host.csv/.md and tensor_parallel_ops.csv/.md to --out.

    python benchmarks/tensor_parallel.py --out DIR                          # 2 GPUs: LLaDA-8B at TP 1 and 2
    python benchmarks/tensor_parallel.py --out DIR --models llada-8b,llada2-mini --dtypes bfloat16,float32
    python benchmarks/tensor_parallel.py --out DIR --models llada2-mini --sizes 1,2,2ep   # experts split whole too
    python benchmarks/tensor_parallel.py --checkpoint CKPT --out DIR        # a checkpoint written once beforehand
    python benchmarks/tensor_parallel.py --out DIR --threads share,all      # the thread shares against none
    python benchmarks/tensor_parallel.py --smoke --out DIR                  # anywhere: a tiny model, two CPU ranks
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

import diffulex_backend.runner as runner_module
from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.profiling import activities_for, device_profile
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES, write_random_checkpoint
from forward import BLOCK, FULL, SMOKE, SMOKE_SHAPE, measure_ceilings
from result_table import ResultTable

FIELDS = ["model", "dtype", "threads", "tp", "batch", "step_ms", "collective_ms", "norm_ms", "speedup", "ideal_speedup",
          "weight_floor_ms", "step_vs_weight_floor", "logit_max_diff", "logit_rel_diff", "outputs", "note"]
PHASES = ["schedule", "broadcast", "build_batch", "forward_launch", "sampler_inputs", "logits", "sample", "accept",
          "read_back", "update"]
HOST_FIELDS = ["model", "dtype", "threads", "tp", "batch", "step_ms", *[f"{p}_ms" for p in PHASES]]
OP_FIELDS = ["model", "dtype", "threads", "tp", "batch", "side", "call", "calls_per_step", "self_ms_per_step"]
TOP_OPS = 12  # rank 0's calls listed per (size, batch) and side, the longest first
PROMPT = 256
NEW_TOKENS = 4 * BLOCK


def collective_ms(profile) -> float:
    """Device time of NCCL kernels and of the one-shot collectives over peer memory, or host time of gloo
    collectives, in ms over the profiled span. Over peer memory the collective also adds a product's split sums as
    it stages them, and after a row-parallel product goes on to the residual-add norm in the same launch
    (one_shot_sum_add_rmsnorm), so that its time holds the norm's; through NCCL and gloo a torch reduce adds the
    splits first, and the norm kernel follows, apart (norm_ms)."""
    return _device_ms(profile, lambda name: "nccl" in name or "_one_shot_" in name, host_prefix="gloo:")


def norm_ms(profile) -> float:
    """Device time of the norm kernel in ms over the profiled span: the norms a step takes outside a collective,
    every norm on one rank. With collective_ms, a step's sums and norms on any path alike."""
    return _device_ms(profile, lambda name: name == "_rmsnorm_kernel")


def _device_ms(profile, wanted, host_prefix: str | None = None) -> float:
    """The device time of the events whose lowercased name is `wanted`, and the host time of those named from
    `host_prefix`, in ms."""
    total_us = 0.0
    for event in profile.key_averages():
        name = event.key.lower()
        if host_prefix is not None and name.startswith(host_prefix):
            total_us += event.cpu_time_total
        elif wanted(name):
            total_us += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return total_us / 1e3


def top_ops(profile, steps: int) -> list[dict]:
    """Rank 0's calls with the most self time in the profiled span, per step. Host: operators, ranges and CUDA
    runtime calls alike. Device: the kernels (and copies) the GPU ran, led by their sum."""
    events = profile.key_averages()
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:TOP_OPS]
    rows = [dict(side="host", call=e.key, calls_per_step=e.count / steps,
                 self_ms_per_step=e.self_cpu_time_total / 1e3 / steps) for e in host]
    if kernels:
        rows.append(dict(side="device", call="all kernels", calls_per_step=sum(e.count for e in kernels) / steps,
                         self_ms_per_step=sum(e.self_device_time_total for e in kernels) / 1e3 / steps))
    rows += [dict(side="device", call=e.key, calls_per_step=e.count / steps,
                  self_ms_per_step=e.self_device_time_total / 1e3 / steps) for e in device]
    return rows


class HostClock:
    """Rank 0's host time per phase of a step: each phase's function wrapped on the engine's own objects (or, for
    the runner module's read_back, in the module for the run's length), accumulating seconds while `on`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.first_logits: torch.Tensor | None = None

    @contextlib.contextmanager
    def timing(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return timed

    @contextlib.contextmanager
    def attached(self, engine):
        """The engine's phases timed while the block runs; every wrapper is an attribute of the instance it times
        (or of the runner module), removed at the end."""
        runner = engine.runner.runner if engine.workers is not None else engine.runner
        methods = [(engine.scheduler, "schedule", "schedule"), (runner, "build_batch", "build_batch"),
                   (runner, "forward", "forward_launch"), (runner, "logit_rows", "sampler_inputs"),
                   (runner, "accept", "accept"),
                   (runner.model, "compute_logits", "logits")]
        if engine.workers is not None:  # the plan's wire form and its broadcast
            methods += [(engine.runner.wire, "encode", "broadcast"), (engine.workers.channel, "broadcast", "broadcast")]
        for owner, name, phase in methods:
            setattr(owner, name, self.wrap(phase, getattr(owner, name)))
        logits = runner.model.compute_logits

        def first_logits(*args, **kwargs):
            out = logits(*args, **kwargs)
            if self.first_logits is None and out.shape[0]:
                self.first_logits = out.detach().to("cpu", torch.float32, copy=True)
            return out

        runner.model.compute_logits = first_logits
        functions = {name: getattr(runner_module, name)
                     for name in ("read_back", "sample", "greedy_over_shards", "upload")}
        for name, phase in (("read_back", "read_back"), ("sample", "sample"), ("greedy_over_shards", "sample"),
                            ("upload", "sampler_inputs")):
            setattr(runner_module, name, self.wrap(phase, functions[name]))
        try:
            yield self
        finally:
            for name, fn in functions.items():
                setattr(runner_module, name, fn)
            for owner, name, _ in methods:
                delattr(owner, name)  # back to the class's method

    def per_step(self, step_seconds: list[float]) -> dict[str, float]:
        steps = len(step_seconds)
        ms = {f"{p}_ms": 1e3 * self.seconds[p] / steps for p in PHASES if p != "update"}
        # Sampling includes the sharded greedy exchange; the sampler's inputs are the logit rows and the uploads of
        # the per-row values (a copy that waits where its host memory is not pinned); the rest of runner.execute
        # (the per-row values built on the host) and the engine's bookkeeping after the read-back are the update.
        ms["update_ms"] = 1e3 * sum(step_seconds) / steps - sum(ms.values())
        return ms


def run_engine(checkpoint: str, size: int, batches: list[int], smoke: bool, device: torch.device,
               dtype: str, **settings) -> dict[int, dict]:
    """One engine at `size` ranks, each batch in turn; per batch its timing, tokens and first decode logits.
    `settings` go to the engine beside the benchmark's own."""
    prompt, new_tokens = (16, 2 * BLOCK) if smoke else (PROMPT, NEW_TOKENS)
    most = max(batches)
    started = time.perf_counter()
    engine = Diffulex(checkpoint, tensor_parallel_size=size, block_size=BLOCK, page_size=32, sampling_mode="topk",
                      enable_prefix_caching=False, max_num_reqs=most, max_model_len=prompt + new_tokens,
                      max_num_batched_tokens=most * (prompt + 2 * BLOCK), dtype=dtype, device=str(device), **settings)
    # Progress on stderr, so that a run cut off by a time limit shows where it was.
    print(f"tp {size}: engine up after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    results = {}
    try:
        for batch in batches:
            generator = torch.Generator().manual_seed(7)
            prompts = [torch.randint(0, 256, (prompt,), generator=generator).tolist() for _ in range(batch)]
            params = SamplingParams(max_tokens=new_tokens, steps=BLOCK, ignore_eos=True, seed=11)
            clock = HostClock()
            warm = 1 if smoke else BLOCK + 2  # one whole block and its commit: each graph bucket is captured

            def decode(during=contextlib.nullcontext) -> tuple[list, list[float]]:
                """One request set: its prefill and warm steps, then each step to its end, inside `during()` (the
                profiler, the clock), which sees no prefill and no warm step. Returns the requests and the seconds
                of each timed step."""
                requests = [engine.requests[engine.add_request(p, params)] for p in prompts]
                for _ in range(1 + warm):  # every prompt's prefill, then the warm steps
                    engine.step_deltas()
                times = []
                with during():
                    while engine.has_unfinished_requests():
                        start = time.perf_counter()
                        engine.step_deltas()
                        times.append(time.perf_counter() - start)
                return requests, times

            profile = device_profile(activities_for(device))
            with clock.attached(engine):
                # Three request sets: the step time on its own, for the profiler slows a host-bound step; the
                # collectives' time under the profiler; the host's phases under the clock.
                requests, times = decode()
                _, profiled = decode(lambda: profile)
                _, host_times = decode(clock.timing)
            results[batch] = dict(
                step_ms=1e3 * statistics.median(times), collective_ms=collective_ms(profile) / len(profiled),
                norm_ms=norm_ms(profile) / len(profiled),
                tokens=[r.tokens[r.gen_start:].tolist() for r in requests], first_logits=clock.first_logits,
                host=dict(step_ms=1e3 * statistics.mean(host_times), **clock.per_step(host_times)),
                ops=top_ops(profile, len(profiled)),
                weight_bytes=sum(p.numel() * p.element_size() for p in engine.model.parameters()),
                threads=torch.get_num_threads())
            print(f"tp {size}, batch {batch}: measured after {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)
    finally:
        engine.close()
        # The next engine sizes its KV cache from the memory free on its GPU: this one's goes back first.
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


@contextlib.contextmanager
def thread_pools(mode: str):
    """Each rank's intra-op threads: the engine's shares ("share"), or every core for every rank ("all")."""
    if mode not in ("share", "all"):
        raise SystemExit(f"--threads takes share and all, got {mode!r}")
    before, configured = torch.get_num_threads(), os.environ.pop("OMP_NUM_THREADS", None)
    if mode == "all":
        cores = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(cores)  # read by the engine for rank 0 and its workers
        torch.set_num_threads(cores)  # one rank: no workers to share with
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if configured is not None:
            os.environ["OMP_NUM_THREADS"] = configured
        torch.set_num_threads(before)


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for request, (x, y) in enumerate(zip(a, b)):
        for position, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return f"request {request} differs first at output position {position}"
    return "equal"


def logit_difference(baseline: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Over the columns both hold (rank 0's share of the vocabulary under tensor parallelism)."""
    columns = min(baseline.shape[1], other.shape[1])
    diff = float((baseline[:, :columns] - other[:, :columns]).abs().max())
    return diff, diff / float(baseline[:, :columns].abs().max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--models", default="llada-8b", help=f"comma-separated, of {sorted(RELEASED_SHAPES)}")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, the first the baseline; a "
                        "value ending in 'ep' (2ep) runs a MoE model with expert_parallel on")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated engine dtypes (default: bfloat16 on a GPU, float32 on a CPU); float32 "
                             "runs with TF32 off on every rank")
    parser.add_argument("--threads", default="share",
                        help="comma-separated: share (each rank's thread pool takes its share of the cores, as the "
                             "engine sets it) and/or all (every rank's pool takes every core, through "
                             "OMP_NUM_THREADS: the oversubscribed host of an engine without the shares)")
    parser.add_argument("--checkpoint", type=pathlib.Path,
                        help="an existing checkpoint directory (e.g. python -m diffulex_backend.testing.checkpoint "
                             "--family llada --shape llada-8b --device cuda DIR) instead of writing a random one for "
                             "each model")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, batch 1 and 2")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        torch.set_num_threads(1)
    sizes = args.sizes.split(",")
    ranks = {size: int(size.removesuffix("ep")) for size in sizes}
    batches = [1, 2] if args.smoke else [int(b) for b in args.batches.split(",")]
    dtypes = (args.dtypes or ("float32" if device.type == "cpu" else "bfloat16")).split(",")
    bandwidth = measure_ceilings(device, SMOKE if args.smoke else FULL).bandwidth
    models = {"smoke": SMOKE_SHAPE} if args.smoke else {m: RELEASED_SHAPES[m] for m in args.models.split(",")}
    if args.checkpoint is not None:
        models = {args.checkpoint.name: None}
    # cuBLAS on every rank (the workers inherit the environment): float32 products in float32, not TF32.
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("tensor_parallel", FIELDS)
    host_table = ResultTable("tensor_parallel_host", HOST_FIELDS, script="tensor_parallel")
    ops_table = ResultTable("tensor_parallel_ops", OP_FIELDS, script="tensor_parallel")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in models.items():
            if shape is None:
                checkpoint = str(args.checkpoint)
            else:
                shape = dict(shape)
                family = shape.pop("model_name")
                written = torch.float32 if device.type == "cpu" else torch.bfloat16
                checkpoint = str(write_random_checkpoint(pathlib.Path(tmp) / name, family, dtype=written,
                                                         num_shards=None, device=device, **shape))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for threads, dtype in itertools.product(args.threads.split(","), dtypes):
                runs = {}
                for size in sizes:
                    with thread_pools(threads):
                        runs[size] = run_engine(checkpoint, ranks[size], batches, args.smoke, device, dtype,
                                                expert_parallel=size.endswith("ep"))
                    base = runs[sizes[0]]
                    for batch in batches:
                        result = runs[size][batch]
                        floor_ms = 1e3 * result["weight_bytes"] / bandwidth  # bytes moved per second, as forward.py
                        diff, rel = logit_difference(base[batch]["first_logits"], result["first_logits"])
                        table.add(model=name, dtype=dtype, threads=threads, tp=size, batch=batch,
                                  step_ms=result["step_ms"], collective_ms=result["collective_ms"],
                                  norm_ms=result["norm_ms"],
                                  speedup=base[batch]["step_ms"] / result["step_ms"],
                                  ideal_speedup=ranks[size] / ranks[sizes[0]], weight_floor_ms=floor_ms,
                                  step_vs_weight_floor=result["step_ms"] / floor_ms, logit_max_diff=diff,
                                  logit_rel_diff=rel, outputs=first_difference(base[batch]["tokens"], result["tokens"]),
                                  note=f"{device}, prompt {16 if args.smoke else PROMPT}, "
                                       f"{result['threads']} threads a rank")
                        host_table.add(model=name, dtype=dtype, threads=threads, tp=size, batch=batch, **result["host"])
                        for op in result["ops"]:
                            ops_table.add(model=name, dtype=dtype, threads=threads, tp=size, batch=batch, **op)
                    # Written after every engine: a run cut off by a time limit keeps the rows it measured.
                    table.write(args.out, argv)
                    host_table.write(args.out, argv)
                    ops_table.write(args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
