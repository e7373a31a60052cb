"""What tensor parallelism's plan broadcast costs on the host: rank 0 encodes each step's SchedulerOutput in its wire
form (plan_wire.PlanWire: what changed since the last step), pickles it and sends it down a pipe to each worker
(workers.Channel); every other rank unpickles and decodes it. Beside it, the plan pickled whole, as it travelled
before the wire form.

Then the trip itself, between two processes as the engine's ranks are: the wire form's frame down a worker's stdin
(workers.Channel), against the broadcast over a gloo group on the loopback that carried it before (a 64 KiB buffer
holding the frame, one round of the group), and against that broadcast of the frame alone, which tells the
transport's part from the buffer's size. The worker answers each frame with one byte on its stdout, so rank 0
times the whole trip; the answer's way is the same for both.

One engine on the CPU (a tiny random model: the plan's size depends on the batch and the contexts, not the weights)
takes --batch requests of the same --context prompt tokens, and steps until every request decodes. The decode step's
plan is sent both ways, the wire form in its steady state (the requests' records were sent the step before). Reports
the bytes, the median of --repeats send (encode and pickle) and receive (unpickle and decode) times, and the median
trip each way goes. Writes plan_broadcast.csv, plan_broadcast_trip.csv and plan_broadcast.md to --out.

    python benchmarks/plan_broadcast.py --out DIR                      # batch 64, 4096-token contexts
    python benchmarks/plan_broadcast.py --out DIR --smoke              # batch 4, 64-token contexts
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.plan_wire import PlanWire
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from diffulex_backend.workers import Channel, frame, plans_pipe, read_frame

GLOO_BUFFER = 1 << 16  # bytes: what the gloo broadcast sent every step, the frame at its start


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


def gloo_group(store, rank: int):
    """The two ranks' control group over the loopback, as workers.connect formed it."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, 2, options)


def broadcast(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def worker(way: str, port: int, repeats: int, buffer_bytes: int) -> None:
    """Rank 1: receives `repeats` frames the given way (over gloo, in a buffer of `buffer_bytes`), and answers each
    with one byte."""
    torch.set_num_threads(1)
    if way == "pipe":
        channel = Channel(None, 1, [plans_pipe()])  # as a worker reads its plans
        receive = channel.broadcast
    else:
        group = gloo_group(dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(minutes=1)), 1)
        buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)

        def receive():
            broadcast(group, buffer)
            return read_frame(io.BytesIO(buffer.numpy()))  # the frame at the buffer's start
    for _ in range(repeats):
        receive()
        sys.stdout.buffer.write(b"!")
        sys.stdout.buffer.flush()


def trip_ms(way: str, message, repeats: int, buffer_bytes: int = GLOO_BUFFER) -> tuple[float, float]:
    """Medians of rank 0's send (until it may go on) and of the whole trip (until the worker's answer arrives), in
    ms, sending `message` `repeats` times the given way to a worker process (over gloo, in a buffer of
    `buffer_bytes`)."""
    store, port = None, 0
    if way == "gloo":
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(minutes=1),
                              wait_for_workers=False)
        port = store.port
    command = [sys.executable, __file__, "--worker", way, "--port", str(port), "--repeats", str(repeats),
               "--buffer-bytes", str(buffer_bytes)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    try:
        if way == "pipe":
            channel = Channel(None, 0, [child.stdin])
            send = lambda: channel.broadcast(message)  # noqa: E731
        else:
            group = gloo_group(store, 0)
            buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)

            def send():  # as Channel.broadcast does: pickled each time
                data = frame(message)
                assert len(data) <= buffer_bytes, "the frame fits one round of the gloo broadcast"
                buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                broadcast(group, buffer)
        sends, trips = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            send()
            sent = time.perf_counter()
            assert child.stdout.read(1) == b"!"
            sends.append((sent - started) * 1e3)
            trips.append((time.perf_counter() - started) * 1e3)
        return statistics.median(sends), statistics.median(trips)
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:  # a run that failed midway: the worker waits for a frame that never comes
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", choices=["pipe", "gloo"], help=argparse.SUPPRESS)  # rank 1 of the trip
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--buffer-bytes", type=int, default=GLOO_BUFFER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.port, args.repeats, args.buffer_bytes)
    if args.out is None:
        parser.error("--out is required")
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
    message = sender.encode(schedule)
    trips = []
    frame_bytes = len(frame(message))
    for way, name, buffer_bytes in (("gloo", "gloo broadcast (before)", GLOO_BUFFER),
                                    ("gloo", "gloo broadcast of the frame alone", frame_bytes),
                                    ("pipe", "pipe (workers.Channel)", 0)):
        send_ms, trip = trip_ms(way, message, args.repeats, buffer_bytes)
        trips.append(dict(way=name, frame_bytes=frame_bytes, send_ms=float(f"{send_ms:.4g}"),
                          trip_ms=float(f"{trip:.4g}")))
    with open(args.out / "plan_broadcast_trip.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(trips[0]))
        writer.writeheader()
        writer.writerows(trips)
    table += ("\n| way | frame bytes | rank 0's send ms | trip ms (to the worker's answer) |\n"
              "|---|---|---|---|\n")
    table += "".join(f"| {t['way']} | {t['frame_bytes']} | {t['send_ms']} | {t['trip_ms']} |\n" for t in trips)
    (args.out / "plan_broadcast.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
