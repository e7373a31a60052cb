"""The tensor-parallel sum alone: NCCL's all-reduce against the one-shot kernel over peer memory, at the sizes a
decode step sums, in CUDA graphs as the engine replays them.

Two ranks (processes, one GPU each) connect as an engine's ranks do (workers.connect). For each size, in one run:
  - µs per call of each way: 50 calls captured in one CUDA graph, the graph replayed, the median of the replays;
  - the floor: the bytes a rank reads from the other's memory / the peer-copy bandwidth measured in the same run
    (a 256 MiB copy from the other GPU);
  - whether the two ways' sums agree bit for bit (with two ranks each is one rounding of a + b).
Sizes are a decode step's rows times the hidden size, in bfloat16: one 32-token block at hidden 4096 is 256 KiB.
Writes all_reduce.csv/.md to --out. Needs two GPUs that reach each other's memory.

    python benchmarks/all_reduce.py --out DIR
    python benchmarks/all_reduce.py --out DIR --sizes 64K,256K,8M --calls 100
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffulex_backend.peer_memory import CAPACITY
from diffulex_backend.workers import connect
from result_table import ResultTable

FIELDS = ["bytes", "rows_at_4096", "nccl_us", "one_shot_us", "speedup", "floor_us", "one_shot_vs_floor", "equal"]
SIZES = "32K,64K,128K,256K,512K,1M,2M,4M,8M"
REPLAYS = 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def graph_us(fn, calls: int) -> float:
    """µs per call of fn, `calls` of them captured in one CUDA graph; the median over REPLAYS replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # outside the capture: NCCL and Triton set up what they need
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def peer_bandwidth(rank: int) -> float:
    """Bytes/s of a copy from the other GPU into this one's memory."""
    n = 256 << 20
    source = torch.empty(n, dtype=torch.uint8, device=f"cuda:{1 - rank}")
    target = torch.empty(n, dtype=torch.uint8, device=f"cuda:{rank}")
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize(rank)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 10 * n / (start.elapsed_time(end) * 1e-3)


def rank_main(rank: int, port: int, sizes: list[int], calls: int, out: pathlib.Path, argv: list[str]) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(minutes=5))
    device = torch.device("cuda", rank)
    _, tp = connect(store, rank, 2, device, expert_parallel=False)
    if tp.peer is None:
        raise SystemExit("the two GPUs do not reach each other's memory: only NCCL would run")
    bandwidth = peer_bandwidth(rank)
    table = ResultTable("all_reduce", FIELDS)
    generator = torch.Generator(device).manual_seed(rank)
    for size in sizes:
        partial = torch.randn(size // 2, generator=generator, device=device).to(torch.bfloat16)
        by_nccl, by_peer = partial.clone(), partial.clone()
        tp.group.allreduce([by_nccl]).wait()
        tp.peer.all_reduce(by_peer)
        equal = torch.equal(by_nccl, by_peer)
        work = partial.clone()
        nccl_us = graph_us(lambda: tp.group.allreduce([work]).wait(), calls)
        one_shot_us = graph_us(lambda: tp.peer.all_reduce(work), calls) if size <= CAPACITY else float("nan")
        floor_us = 1e6 * size / bandwidth
        if rank == 0:
            table.add(bytes=size, rows_at_4096=size // (2 * 4096), nccl_us=nccl_us, one_shot_us=one_shot_us,
                      speedup=nccl_us / one_shot_us, floor_us=floor_us, one_shot_vs_floor=one_shot_us / floor_us,
                      equal=equal)
    if rank == 0:
        table.write(out, argv)
        print(f"peer copy {bandwidth / 1e9:.1f} GB/s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--sizes", default=SIZES, help="bytes a call sums (K and M suffixes)")
    parser.add_argument("--calls", type=int, default=50, help="calls a graph captures")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    args.out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(minutes=5), wait_for_workers=False)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    mp.spawn(rank_main, args=(store.port, sizes, args.calls, args.out, argv if argv is not None else sys.argv[1:]),
             nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
