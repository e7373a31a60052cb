"""What tensor parallelism's plan broadcast costs on the host: rank 0 pickles each step's SchedulerOutput and sends
it over the control group (workers.Channel), and every other rank unpickles it.

One engine on the CPU (a tiny random model: the plan's size depends on the batch and the contexts, not the weights)
takes --batch requests of the same --context prompt tokens, and steps until every request decodes; the decode step's plan is
then pickled as Channel.broadcast pickles it. Reports its bytes, and the median of --repeats pickle and unpickle
times. Writes plan_broadcast.csv and plan_broadcast.md to --out.

    python benchmarks/plan_broadcast.py --out DIR                      # batch 64, 4096-token contexts
    python benchmarks/plan_broadcast.py --out DIR --smoke              # batch 4, 64-token contexts
"""
from __future__ import annotations

import argparse
import csv
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint


def decode_plan(checkpoint: Path, batch: int, context: int, block: int):
    engine = Diffulex(str(checkpoint), block_size=block, page_size=32, max_model_len=context + 2 * block,
                      max_num_reqs=batch, max_num_batched_tokens=max(4096, batch * block), device="cpu",
                      warm_up=False)
    params = SamplingParams(max_tokens=2 * block, ignore_eos=True)
    # One prompt for all: after the first request's prefill the others find its pages in the prefix cache, so the
    # run reaches the decode step in seconds. A plan carries each request's page table all the same.
    prompt = [3 + j % 200 for j in range(context)]
    for _ in range(batch):
        engine.add_request(prompt, params)
    while True:
        engine.step()
        plans = engine.last_schedule.plans
        if len(plans) == batch and all(plan.blocks for plan in plans):  # every request decodes a block
            return engine.last_schedule


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    batch, context, block = (4, 64, 4) if args.smoke else (args.batch, args.context, 32)
    with tempfile.TemporaryDirectory() as work:
        checkpoint = write_random_checkpoint(Path(work) / "llada", "llada",
                                             max_position_embeddings=context + 2 * block)
        schedule = decode_plan(checkpoint, batch, context, block)
    data = pickle.dumps(schedule, protocol=pickle.HIGHEST_PROTOCOL)
    pickle_ms = median_ms(lambda: pickle.dumps(schedule, protocol=pickle.HIGHEST_PROTOCOL), args.repeats)
    unpickle_ms = median_ms(lambda: pickle.loads(data), args.repeats)
    row = dict(batch=batch, context=context, plan_bytes=len(data),
               page_table_entries=sum(len(plan.page_table) for plan in schedule.plans),
               pickle_ms=float(f"{pickle_ms:.4g}"), unpickle_ms=float(f"{unpickle_ms:.4g}"))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "plan_broadcast.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    table = ("| batch | context | plan bytes | page-table entries | pickle ms | unpickle ms |\n"
             "|---|---|---|---|---|---|\n"
             f"| {row['batch']} | {row['context']} | {row['plan_bytes']} | {row['page_table_entries']} | "
             f"{row['pickle_ms']} | {row['unpickle_ms']} |\n")
    (args.out / "plan_broadcast.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
