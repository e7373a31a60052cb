"""Sparse attention by page retention on a long prompt: KV memory per request and ms per decode step at each
retention_ratio, in one run, against ratio 1.0 (dense).

For each batch in --batches and each ratio in --ratios: a random-weight model of the --model shape (built on the
device), `batch` requests of a --prompt-token random prompt decoding one 32-token block at a time, one token per
block per step (the top-k schedule, so random weights cannot change how much a step decodes). After the step that
chooses the pages, it reports:
  - KV pages and MiB per request, read off the KV pool's accounting (pages in use / batch);
  - ms per decode step (engine.step), the median over the timed steps, and its ratio to ratio 1.0's;
  - the step's floor: the weights plus the K/V the attention reads, over the measured HBM bandwidth;
  - the time of the step (or steps) that chose the pages: one eager forward of the measured requests more.
Writes retention.csv and retention.md to --out.

    python benchmarks/retention.py --out DIR                                  # GPU: LLaDA-8B, 4096-token prompt
    python benchmarks/retention.py --smoke --out DIR                          # anywhere: a tiny model
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from diffulex_backend import SamplingParams  # noqa: E402
from diffulex_backend.testing.checkpoint import random_model  # noqa: E402
from forward import (BLOCK, PAGE_SIZE, long_prompt_arguments, long_prompt_setup, make_engine,  # noqa: E402
                     measure_ceilings, page_bytes, synchronize, write_model_dir)
from result_table import ResultTable  # noqa: E402

FIELDS = ["model", "batch", "prompt", "retention_ratio", "kv_pages_per_request", "kv_mib_per_request", "step_ms",
          "step_vs_dense", "floor_ms", "step_vs_floor", "choose_step_ms", "note"]


def run(model, model_dir: str, device, plan, batch: int, prompt: int, ratio: float, timed: int) -> dict:
    new_tokens = 2 * BLOCK
    pages = batch * -(-(prompt + new_tokens) // PAGE_SIZE) + 8
    engine = make_engine(model, model_dir, device, plan, sampling_mode="topk", max_model_len=prompt + new_tokens,
                         max_num_reqs=batch, max_num_batched_tokens=batch * (prompt + 2 * BLOCK), num_kv_pages=pages,
                         retention_ratio=ratio)
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=new_tokens, steps=BLOCK, ignore_eos=True)
    requests = [engine.requests[engine.add_request(torch.randint(0, 256, (prompt,), generator=generator).tolist(),
                                                   params)] for _ in range(batch)]
    engine.step()  # prefill
    choosing = []  # the steps that measure attention and choose the pages (one eager forward more)
    while any(r.retention_pending for r in requests):
        start = time.perf_counter()
        engine.step()
        choosing.append(time.perf_counter() - start)
    for _ in range(2):  # the compacted page tables' graph buckets
        engine.step()
    used = engine.kv_cache.num_used_pages
    synchronize(device)
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    context_pages = used  # every page a request holds is read by each step's attention
    return dict(pages=used / batch, step_ms=1e3 * statistics.median(times), context_pages=context_pages,
                choose_ms=1e3 * sum(choosing))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    long_prompt_arguments(parser)
    parser.add_argument("--ratios", default="1.0,0.5,0.3")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a 256-token prompt, one timed step")
    args = parser.parse_args(argv)
    prompt, timed = (256, 1) if args.smoke else (args.prompt, 2 * BLOCK - 4)
    device, plan, shape, name, dtype = long_prompt_setup(args.model, args.smoke, prompt)
    bandwidth = measure_ceilings(device, plan).bandwidth  # bytes moved per second, as forward.py's floors use it
    model = random_model(**shape, dtype=dtype, device=device, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("retention", FIELDS)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(shape, pathlib.Path(tmp) / name)
        for batch in [int(b) for b in args.batches.split(",")]:
            dense_ms = None
            for ratio in [float(r) for r in args.ratios.split(",")]:
                result = run(model, model_dir, device, plan, batch, prompt, ratio, timed)
                dense_ms = dense_ms or result["step_ms"]
                floor_ms = 1e3 * (weight_bytes + result["context_pages"] * page_bytes(model)) / bandwidth
                table.add(model=name, batch=batch, prompt=prompt, retention_ratio=ratio,
                          kv_pages_per_request=result["pages"],
                          kv_mib_per_request=result["pages"] * page_bytes(model) / 2**20, step_ms=result["step_ms"],
                          step_vs_dense=result["step_ms"] / dense_ms, floor_ms=floor_ms,
                          step_vs_floor=result["step_ms"] / floor_ms, choose_step_ms=result["choose_ms"],
                          note=f"{device}, {dtype}, page {PAGE_SIZE}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    table.write(args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
