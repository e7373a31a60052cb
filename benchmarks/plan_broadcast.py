"""What tensor parallelism's plan broadcast costs on the host: rank 0 encodes each step's SchedulerOutput in its wire
form (plan_wire.PlanWire: what changed since the last step), pickles it and sends it over the control group
(workers.Channel); every other rank unpickles and decodes it. Beside it, the plan pickled whole, as it travelled
before the wire form.

One engine on the CPU (a tiny random model: the plan's size depends on the batch and the contexts, not the weights)
takes --batch requests of the same --context prompt tokens, and steps until every request decodes. The decode step's
plan is sent both ways, the wire form in its steady state (the requests' records were sent the step before). Reports
the bytes, and the median of --repeats send (encode and pickle) and receive (unpickle and decode) times. Writes
plan_broadcast.csv and plan_broadcast.md to --out.

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
from diffulex_backend.plan_wire import PlanWire
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
    sender, receiver = PlanWire(), PlanWire()
    receiver.decode(pickle.loads(pickle.dumps(sender.encode(schedule))))  # the records' first step
    ways = {
        "pickled whole": (lambda: pickle.dumps(schedule, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
        "wire form": (lambda: pickle.dumps(sender.encode(schedule), protocol=pickle.HIGHEST_PROTOCOL),
                      lambda data: receiver.decode(pickle.loads(data))),
    }
    rows = []
    for way, (send, receive) in ways.items():
        data = send()
        rows.append(dict(way=way, batch=batch, context=context, plan_bytes=len(data),
                         page_table_entries=sum(len(plan.page_table) for plan in schedule.plans),
                         send_ms=float(f"{median_ms(send, args.repeats):.4g}"),
                         receive_ms=float(f"{median_ms(lambda: receive(data), args.repeats):.4g}")))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "plan_broadcast.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = ("| way | batch | context | plan bytes | page-table entries | send ms | receive ms |\n"
             "|---|---|---|---|---|---|---|\n")
    table += "".join(f"| {r['way']} | {r['batch']} | {r['context']} | {r['plan_bytes']} | {r['page_table_entries']} | "
                     f"{r['send_ms']} | {r['receive_ms']} |\n" for r in rows)
    (args.out / "plan_broadcast.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
