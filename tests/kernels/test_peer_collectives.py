"""The one-shot collectives over peer memory (kernels/peer_collectives.py): the all-reduce gives every rank the same
sum, the rank-order float32 sum rounded once, and the all-gather every rank's tensor in rank order, call after call
and one kind after the other: the flags, the counts and the two staging halves keep ranks that run ahead from
overwriting what another still reads.

On the CPU the ranks are processes (Triton's interpreter runs one kernel at a time in a process) over buffers in
shared memory, each with the addresses it maps them at. On two GPUs the ranks connect as an engine's do
(workers.connect) and the kernels are held to NCCL's sums and gathers, eagerly, replayed in a CUDA graph, and many
back to back in one graph. On one GPU a rank that never arrives fails the launch once the timeout has passed,
instead of hanging the engine."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.multiprocessing as mp

from kernel_cases import DEVICE, assert_equal_after_rounding

PROGRAMS = 3
HALF_SIZE = 7000  # elements of the staging halves, in the test's dtype
# Sizes past what the programs move in one pass (3 x 2048), a single element, and the whole half.
SIZES = [7, 4096, 6145, 1, 2049, HALF_SIZE, 300, 6144 - 1]
# Calls that gather int64 instead, as the greedy step gathers float32 beside bfloat16 sums: another dtype, through
# the same staging buffer and counts.
GATHERS = {3, 6}


def call_input(call: int, size: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if call in GATHERS:
        return torch.randint(-2**62, 2**62, (size,), generator=generator).share_memory_()
    return (torch.randn(size, generator=generator) * 8).to(dtype).share_memory_()


def interpreted_rank(rank, world, dtype, staging, flags, inputs, outputs):
    from diffulex_kernels.peer_collectives import one_shot_all_gather, one_shot_all_reduce

    from diffulex_backend.peer_memory import staging_offset

    staging_offsets = torch.tensor([staging_offset(s, staging[rank]) for s in staging], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    counts = torch.zeros(PROGRAMS, dtype=torch.int64)
    for call, (x, out) in enumerate(zip(inputs[rank], outputs[rank])):
        if call in GATHERS:
            everyone = one_shot_all_gather(x, staging[rank].view(x.dtype), staging_offsets, flag_ptrs, counts, rank)
            assert everyone.shape == (world, x.numel())
            for peer in range(world):  # a copy: bit for bit
                assert torch.equal(everyone[peer], inputs[peer][call]), (rank, call, peer)
            continue
        summed = x.clone()
        assert one_shot_all_reduce(summed, staging[rank], staging_offsets, flag_ptrs, counts, rank) is summed
        out.copy_(summed)
    assert counts.tolist() == [len(SIZES)] * PROGRAMS


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's twin of the two-GPU test")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_rank_gets_the_rank_order_sum_call_after_call(world, dtype):
    generator = torch.Generator().manual_seed(world)
    staging = [torch.zeros(2 * HALF_SIZE, dtype=dtype).share_memory_() for _ in range(world)]
    flags = [torch.zeros(PROGRAMS, world, dtype=torch.int64).share_memory_() for _ in range(world)]
    inputs = [[call_input(call, n, dtype, generator) for call, n in enumerate(SIZES)] for _ in range(world)]
    outputs = [[torch.full((n,), float("nan"), dtype=dtype).share_memory_() for n in SIZES] for _ in range(world)]
    context = mp.get_context("spawn")
    ranks = [context.Process(target=interpreted_rank, args=(rank, world, dtype, staging, flags, inputs, outputs))
             for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(300)
    for process in ranks:  # one that hangs must not keep the session waiting at its exit
        if process.is_alive():
            process.kill()
    assert [process.exitcode for process in ranks] == [0] * world  # each rank checked every gather itself
    for call in set(range(len(SIZES))) - GATHERS:
        expected = sum(inputs[rank][call].float() for rank in range(world)).to(dtype)
        for rank in range(world):
            assert torch.equal(outputs[rank][call], outputs[0][call])  # one sum, whichever rank asks
            assert_equal_after_rounding(outputs[rank][call], expected)
    # Each rank's flags hold, from every rank, the count of its last call; the last two calls' partials sit in the
    # two halves of each rank's staging buffer, the call with count c in half c % 2: a rank that runs a call ahead
    # writes the half no rank reads any more.
    calls = len(SIZES)
    assert all((f == calls).all() for f in flags)
    for rank in range(world):
        for count in (calls, calls - 1):
            partial = inputs[rank][count - 1]
            halves = staging[rank].view(partial.dtype).view(2, -1)  # as the call viewed it: the same bytes halved
            assert torch.equal(halves[count % 2][:partial.numel()], partial)


def gpu_rank(rank, port, results):
    import torch.distributed as dist

    from diffulex_backend.workers import connect

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(minutes=2))
    device = torch.device("cuda", rank)
    _, tp = connect(store, rank, 2, device, expert_parallel=False)
    assert tp.peer is not None, "the two GPUs do not reach each other's memory"
    generator = torch.Generator(device).manual_seed(rank)
    agree = []
    for rows in (1, 32, 1024):  # a token, one block, 32 blocks, at hidden 4096: the last fills the staging half
        partial = torch.randn(rows, 4096, generator=generator, device=device).to(torch.bfloat16)
        by_nccl, by_peer = partial.clone(), partial.clone()
        tp.group.allreduce([by_nccl]).wait()
        assert tp.peer.fits(by_peer, summed=True)
        tp.all_reduce(by_peer)  # the engine's call takes the peer path for these sizes
        agree.append(torch.equal(by_nccl, by_peer))
        # Replayed in a graph, with fresh inputs each replay.
        static = partial.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tp.all_reduce(static)
        for step in range(3):
            fresh = partial * (step + 2)
            static.copy_(fresh)
            graph.replay()
            tp.group.allreduce([fresh]).wait()
            agree.append(torch.equal(static, fresh))
        # The greedy step's exchange: a few float32 numbers a row, gathered.
        stats = torch.randn(rows, 7, generator=generator, device=device)
        by_nccl = torch.empty(2 * rows, 7, device=device)
        tp.group._allgather_base(by_nccl, stats).wait()
        agree.append(torch.equal(tp.gather(stats), by_nccl.view(2, rows, 7)))
    # Calls back to back in one graph, as a step makes them: sums and gathers, of mixed sizes and dtypes, with no
    # host work between them, so that a rank may run calls ahead of the other.
    shapes = [(32, 4096), (1, 4096), (1024, 4096), (32, 7), (7, 4096), (32, 7)] * 3
    statics = [torch.randn(shape, generator=generator, device=device).to(torch.float32 if shape[1] == 7
                                                                         else torch.bfloat16) for shape in shapes]
    inputs = [t.clone() for t in statics]
    for t in statics:  # every launch compiled before the capture; the calls count alike on both ranks
        tp.gather(t) if t.dtype == torch.float32 else tp.all_reduce(t.clone())
    gathered = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i, t in enumerate(statics):
            if t.dtype == torch.float32:
                gathered[i] = tp.gather(t)
            else:
                tp.all_reduce(t)
    graph.replay()
    for i, (t, x) in enumerate(zip(statics, inputs)):
        if x.dtype == torch.float32:
            reference = torch.empty(2 * x.shape[0], x.shape[1], device=device)
            tp.group._allgather_base(reference, x).wait()
            agree.append(torch.equal(gathered[i], reference.view(2, *x.shape)))
        else:
            reference = x.clone()
            tp.group.allreduce([reference]).wait()
            agree.append(torch.equal(t, reference))
    results[rank] = agree


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs that reach each other's memory")
def test_two_gpus_sum_and_gather_as_nccl_does_eagerly_and_in_graphs():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(minutes=2), wait_for_workers=False)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(gpu_rank, args=(store.port, results), nprocs=2)
    assert dict(results) == {0: [True] * 33, 1: [True] * 33}


ABSENT_RANK = textwrap.dedent("""
    import torch
    from diffulex_kernels.peer_collectives import one_shot_all_reduce

    # Rank 0 of two, whose partner never raises its flag.
    staging = [torch.zeros(2 * 4096, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    flags = [torch.zeros(4, 2, dtype=torch.int64, device="cuda") for _ in range(2)]
    staging_offsets = torch.tensor([(s.data_ptr() - staging[0].data_ptr()) // 16 for s in staging], device="cuda")
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device="cuda")
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    one_shot_all_reduce(x, staging[0], staging_offsets, flag_ptrs, counts, 0, timeout_ns=200_000_000)
    torch.cuda.synchronize()
    print("returned")
""")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the timeout runs on a GPU's clock")
def test_a_rank_that_never_arrives_fails_the_launch_after_the_timeout():
    done = subprocess.run([sys.executable, "-c", ABSENT_RANK], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "device-side assert" in done.stderr or "a rank did not arrive in time" in done.stderr, done.stderr[-2000:]
