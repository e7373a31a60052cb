"""What a torch.profiler recording leaves behind: a CUDA graph's launch time on the host before and after each of
three recordings, with CUPTI torn down when a recording stops (TEARDOWN_CUPTI=1, as diffulex_backend.profiling's
device_profile sets it) and without (TEARDOWN_CUPTI=0, torch's default here). Each setting runs in a process of its
own, since the variable acts for the life of the process. The graph is graph_launch.py's: 330 dependent
one-program kernels over 16 distinct ones, about an fp8 LLaDA-8B forward's count. After each recording the replay's
result is checked, and the recording's device events are counted, so that a teardown that broke the next recording
would show.

    python benchmarks/profiler_residue.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

from diffulex_backend.profiling import device_profile
from diffulex_kernels.pdl import use_pdl
from graph_launch import GraphKind, captured
from result_table import ResultTable

NODES = 330
KERNELS = 16  # distinct kernels among the nodes, as a forward has many
RECORDINGS = (("CUDA",), ("CPU", "CUDA"), ("CPU", "CUDA"))


def replay_host_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median time replay() holds the host, each replay on an idle GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def child(reps: int) -> None:
    """One setting's rows, as JSON lines on stdout."""
    x = torch.zeros(128, device="cuda")
    graph = captured(NODES, GraphKind(use_pdl(x), kernels=KERNELS), x)
    before = replay_host_us(graph, reps)
    for index, names in enumerate(RECORDINGS):
        with device_profile([getattr(torch.profiler.ProfilerActivity, n) for n in names]) as recording:
            graph.replay()
            torch.cuda.synchronize()
        events = sum(1 for e in recording.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        x.zero_()
        graph.replay()
        right = bool((x == sum(node % KERNELS for node in range(NODES))).all())  # each node adds its kernel's index
        print(json.dumps(dict(recording=index + 1, activities="+".join(names), device_events=events,
                              host_us_before=before, host_us_after=replay_host_us(graph, reps), replay_right=right)),
              flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--reps", type=int, default=50, help="replays timed at each point")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profiler_residue.py times CUDA graphs: it needs a CUDA GPU")
    if args.child:
        child(args.reps)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("profiler_residue", ["teardown_cupti", "recording", "activities", "device_events",
                                             "replay_right", "host_us_before", "host_us_after", "after_over_before"])
    for teardown in ("0", "1"):
        env = dict(os.environ, TEARDOWN_CUPTI=teardown)
        lines = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)], env=env, check=True,
                               capture_output=True, text=True).stdout.splitlines()
        for row in (json.loads(line) for line in lines if line.startswith("{")):
            table.add(teardown_cupti=teardown, **row, after_over_before=row["host_us_after"] / row["host_us_before"])
    table.write(args.out, argv if argv is not None else sys.argv[1:])
    print(torch.cuda.get_device_name(0), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
