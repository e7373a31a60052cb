"""Tensor parallelism against one rank, in one run: the same random-weight checkpoint and the same prompts.

For each model, each tensor_parallel_size in --sizes (the first is the baseline) and each batch in --batches,
with one 32-token block per request decoded under the top-k schedule (one token per block per step, so random
weights cannot change how much a step decodes):
  - the greedy outputs against the baseline's: equal, or the first request and position where they differ;
  - ms per decode step (engine.step, after every prompt's prefill), the median over the timed steps;
  - the collectives' ms per step on rank 0 (torch.profiler: NCCL kernels on GPUs, gloo ops on a CPU);
  - the speed-up over the baseline, beside the ideal one (the size ratio: at batch 1 a step streams the weights,
    and each rank streams 1/N of them);
  - the weight-streaming floor of one rank: its share of the model's bytes / the measured HBM bandwidth.
Writes tensor_parallel.csv and tensor_parallel.md to --out.

    python benchmarks/tensor_parallel.py --out DIR                          # 2 GPUs: LLaDA-8B at TP 1 and 2
    python benchmarks/tensor_parallel.py --out DIR --models llada-8b,llada2-mini
    python benchmarks/tensor_parallel.py --checkpoint CKPT --out DIR        # a checkpoint written once beforehand
    python benchmarks/tensor_parallel.py --smoke --out DIR                  # anywhere: a tiny model, two CPU ranks
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from source_checkout import map_kernels_package  # noqa: E402

map_kernels_package()

from diffulex_backend import Diffulex, SamplingParams  # noqa: E402
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES, write_random_checkpoint  # noqa: E402
from forward import BLOCK, FULL, SMOKE, SMOKE_SHAPE, measure_ceilings  # noqa: E402
from result_table import ResultTable  # noqa: E402

FIELDS = ["model", "tp", "batch", "step_ms", "collective_ms", "speedup", "ideal_speedup", "weight_floor_ms",
          "step_vs_weight_floor", "outputs", "note"]
PROMPT = 256
NEW_TOKENS = 4 * BLOCK


def collective_ms(profile) -> float:
    """Device time of NCCL kernels, or host time of gloo collectives, in ms over the profiled span."""
    total_us = 0.0
    for event in profile.key_averages():
        name = event.key.lower()
        if "nccl" in name:
            total_us += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        elif name.startswith("gloo:"):
            total_us += event.cpu_time_total
    return total_us / 1e3


def run_engine(checkpoint: str, size: int, batch: int, smoke: bool, device: torch.device) -> dict:
    prompt, new_tokens = (16, 2 * BLOCK) if smoke else (PROMPT, NEW_TOKENS)
    engine = Diffulex(checkpoint, tensor_parallel_size=size, block_size=BLOCK, page_size=32, sampling_mode="topk",
                      enable_prefix_caching=False, max_num_reqs=batch, max_model_len=prompt + new_tokens,
                      max_num_batched_tokens=batch * (prompt + 2 * BLOCK),
                      dtype="float32" if device.type == "cpu" else "bfloat16", device=str(device))
    try:
        generator = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, 256, (prompt,), generator=generator).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=new_tokens, steps=BLOCK, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        requests = [engine.requests[i] for i in ids]
        engine.step()  # every prompt's prefill
        warm = 1 if smoke else BLOCK + 2  # one whole block and its commit: each graph bucket is captured
        for _ in range(warm):
            engine.step()
        times = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
        tokens = [r.tokens[r.gen_start:].tolist() for r in requests]
        return dict(step_ms=1e3 * statistics.median(times), collective_ms=collective_ms(profile) / len(times),
                    tokens=tokens, weight_bytes=sum(p.numel() * p.element_size() for p in engine.model.parameters()))
    finally:
        engine.close()


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for request, (x, y) in enumerate(zip(a, b)):
        for position, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return f"request {request} differs first at output position {position}"
    return "equal"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--models", default="llada-8b", help=f"comma-separated, of {sorted(RELEASED_SHAPES)}")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values; the first is the baseline")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--checkpoint", type=pathlib.Path,
                        help="an existing checkpoint directory (e.g. python -m diffulex_backend.testing.checkpoint "
                             "--family llada --shape llada-8b DIR) instead of writing a random one for each model")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, batch 1 and 2")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = (1, 2) if args.smoke else tuple(int(b) for b in args.batches.split(","))
    bandwidth = measure_ceilings(device, SMOKE if args.smoke else FULL).bandwidth
    models = {"smoke": SMOKE_SHAPE} if args.smoke else {m: RELEASED_SHAPES[m] for m in args.models.split(",")}
    if args.checkpoint is not None:
        models = {args.checkpoint.name: None}
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("tensor_parallel", FIELDS)
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in models.items():
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
            if shape is None:
                checkpoint = str(args.checkpoint)
            else:
                shape = dict(shape)
                family = shape.pop("model_name")
                checkpoint = str(write_random_checkpoint(pathlib.Path(tmp) / name, family, dtype=dtype,
                                                         num_shards=None, **shape))
            for batch in batches:
                baseline = None
                for size in sizes:
                    result = run_engine(checkpoint, size, batch, args.smoke, device)
                    baseline = baseline or dict(result, size=size)
                    floor_ms = 1e3 * result["weight_bytes"] / bandwidth  # bytes moved per second, as in forward.py
                    table.add(model=name, tp=size, batch=batch, step_ms=result["step_ms"],
                              collective_ms=result["collective_ms"], speedup=baseline["step_ms"] / result["step_ms"],
                              ideal_speedup=size / baseline["size"], weight_floor_ms=floor_ms,
                              step_vs_weight_floor=result["step_ms"] / floor_ms,
                              outputs=first_difference(baseline["tokens"], result["tokens"]),
                              note=f"{device}, {dtype}, prompt {PROMPT if not args.smoke else 16}")
    table.write(args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
