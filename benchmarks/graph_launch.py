"""What launching a CUDA graph costs the host, and how long the GPU waits for it, by the graph's node count.

A decode forward at batch 1 is one graph of about 300 to 500 short kernels (LLaDA-8B: about 300 in bf16, 330 in fp8), each
launched dependent on the one before (programmatic dependent launch, kernels/pdl.py). For each node count, with the
kernels launched plainly and dependent, dependent with every 32nd launched plainly, dependent with one
device-to-device copy among them, and dependent over 16 distinct kernels, in one run:
  - host_us: the median time `CUDAGraph.replay()` holds the host;
  - alone_us: one replay timed by events on an idle GPU: the host's launch is on its critical path;
  - busy_us: one replay queued behind a kernel that keeps the GPU busy: the graph's own device time;
  - exposed_us = alone_us - busy_us: what the launch leaves the GPU waiting, per forward.
Each node is one program storing 128 floats, so busy_us is the nodes' launch gaps and not their work. Where a graph
of dependent launches replays slower queued behind a busy GPU than alone (as on an H200), its exposed_us is negative
and says only that busy_us is not its own time there.
Writes graph_launch.csv/.md to --out. Needs a CUDA GPU (Hopper or later for the dependent launches).

    python benchmarks/graph_launch.py --out DIR
    python benchmarks/graph_launch.py --out DIR --nodes 32,330,1000 --reps 50
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from diffulex_kernels.pdl import use_pdl, wait_for_previous_kernel
from result_table import ResultTable

NODES = "32,128,330,500,1000"


@triton.jit
def _node_kernel(x_ptr, USE_PDL: tl.constexpr, KERNEL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    offs = tl.arange(0, 128)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + KERNEL)


@dataclass(frozen=True)
class GraphKind:
    """A graph's makeup: its nodes launched dependent or plainly; with `plain_every`, every so many of the dependent
    nodes launched plainly (as a forward's torch kernels are among its Triton ones); how many device-to-device
    copies it holds (a memcpy node each, as a tensor's `copy_` captures); and how many distinct kernels its nodes
    cycle through (each value of KERNEL compiles a kernel of its own, as a forward's many Triton kernels are)."""
    dependent: bool
    plain_every: int = 0
    copies: int = 0
    kernels: int = 1


def captured(nodes: int, kind: GraphKind, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    copy_after = {nodes * (i + 1) // (kind.copies + 1) for i in range(kind.copies)}
    y = torch.empty_like(x)

    def launches():
        for node in range(nodes):
            dependent = kind.dependent and not (kind.plain_every and node % kind.plain_every == 0)
            _node_kernel[(1,)](x, USE_PDL=dependent, KERNEL=node % kind.kernels, launch_pdl=dependent, num_warps=1)
            if node in copy_after:
                y.copy_(x)

    launches()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_times(graph: torch.cuda.CUDAGraph, reps: int, busy_cycles: int) -> tuple[float, float, float]:
    """Medians, in µs, of: the host's time in replay(); one replay on an idle GPU; one replay behind a busy GPU."""
    host, alone, busy = [], [], []
    for behind in (False, True):
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if behind:
                torch.cuda._sleep(busy_cycles)  # the replay is queued while this runs
            start.record()
            began = time.perf_counter()
            graph.replay()
            held = time.perf_counter() - began
            end.record()
            end.synchronize()
            (busy if behind else alone).append(start.elapsed_time(end) * 1e3)
            if not behind:
                host.append(held * 1e6)
    return statistics.median(host), statistics.median(alone), statistics.median(busy)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--nodes", default=NODES, help="node counts of the graphs, comma-separated")
    parser.add_argument("--reps", type=int, default=30, help="replays timed each way")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch.py times CUDA graphs: it needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    x = torch.zeros(128, device="cuda")
    # Long enough to cover the longest launch measured (2 ms at the GPU's clock), so the replay waits behind it.
    busy_cycles = int(getattr(torch.cuda.get_device_properties(0), "clock_rate", 2_000_000) * 2)  # kHz * 2 ms
    table = ResultTable("graph_launch", ["nodes", "dependent", "plain_every", "copies", "kernels", "host_us",
                                         "alone_us", "busy_us", "exposed_us", "exposed_us_per_node"])
    dependent = use_pdl(x)
    kinds = dict.fromkeys((GraphKind(False), GraphKind(dependent), GraphKind(dependent, plain_every=32),
                           GraphKind(dependent, copies=1), GraphKind(dependent, kernels=16)))
    for nodes in (int(n) for n in args.nodes.split(",")):
        for kind in kinds:
            graph = captured(nodes, kind, x)
            host, alone, busy = replay_times(graph, args.reps, busy_cycles)
            table.add(nodes=nodes, dependent=kind.dependent, plain_every=kind.plain_every, copies=kind.copies,
                      kernels=kind.kernels, host_us=host, alone_us=alone, busy_us=busy, exposed_us=alone - busy,
                      exposed_us_per_node=(alone - busy) / nodes)
            del graph
    table.write(args.out, argv if argv is not None else sys.argv[1:])
    print(torch.cuda.get_device_name(0), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
