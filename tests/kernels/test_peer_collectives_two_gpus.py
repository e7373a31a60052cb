"""The one-shot collectives over peer memory (kernels/peer_collectives.py) on two GPUs: the ranks connect as an
engine's do (workers.connect), and the kernels are held to NCCL's sums and gathers bit for bit, eagerly, replayed in
a CUDA graph, and many back to back in one graph; a product's split sums, to their in-order sum's, and ending in the
norm, to the norm kernel's, eagerly and back to back in that graph between the sums and gathers. `make gpu-check` runs it in its two-GPU section;
tests/unit/test_peer_collectives_interpreted.py is its twin under the interpreter."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.multiprocessing as mp


# What a rank checks: 7 for each of three sizes eagerly, 6 for each of two split sums' sizes, and in the back-to-back
# graph the counts, then 8 sums and gathers, 5 norms writing float rows (2 each) and 2 writing fp8 rows (3 each).
N_CHECKS = 3 * 7 + 2 * 6 + 1 + 8 + 5 * 2 + 2 * 3


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
        before = tp.peer.counts.clone()
        tp.all_reduce(by_peer)  # the engine's call takes the peer path for these sizes
        agree.append(torch.equal(tp.peer.counts, before + 1))  # the kernel ran: NCCL would leave the counts
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
        before = tp.peer.counts.clone()
        agree.append(torch.equal(tp.gather(stats), by_nccl.view(2, rows, 7)))
        agree.append(torch.equal(tp.peer.counts, before + 1))
    # A row-parallel product's float32 split sums at a block's rows and at two blocks': summed over the splits in
    # order and over the ranks (sum_partials), and ending in the residual-add norm, bf16 or fp8 rows, against the
    # in-order sum, NCCL's all-reduce and the norm kernel at its own warps. The residual and the norm's
    # weight are the same on both ranks, as the engine's are.
    from diffulex_kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_fp8

    shared = torch.Generator(device).manual_seed(99)
    for rows in (32, 64):
        partials = torch.randn(4, rows, 4096, generator=generator, device=device)
        residual = torch.randn(rows, 4096, generator=shared, device=device).to(torch.bfloat16)
        weight = (1 + torch.randn(4096, generator=shared, device=device) / 4).to(torch.bfloat16)
        summed = partials[0] + partials[1] + partials[2] + partials[3]
        tp.group.allreduce([summed]).wait()
        before = tp.peer.counts.clone()
        agree.append(torch.equal(tp.sum_partials(partials.clone()), summed))
        agree.append(torch.equal(tp.peer.counts, before + 1))
        rows_out, residual_out = tp.peer.sum_add_rmsnorm(partials, residual, weight, 1e-6, fp8=False)
        want_rows, want_residual = fused_add_rmsnorm(summed, residual, weight, 1e-6)
        agree += [torch.equal(rows_out, want_rows), torch.equal(residual_out, want_residual)]
        (q, scale), _ = tp.peer.sum_add_rmsnorm(partials, residual, weight, 1e-6, fp8=True)
        (want_q, want_scale), _ = fused_add_rmsnorm_fp8(summed, residual, weight, 1e-6)
        agree += [torch.equal(scale, want_scale), torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))]
    # Calls back to back in one graph, as a step makes them: sums, gathers and sums that end in the norm, of mixed
    # sizes and dtypes, with no host work between them, so that a rank may run calls ahead of the other. The norm's
    # calls own whole rows and the others chunks of 2048 values, and all write the same two staging halves in turn:
    # each call here writes the half its call-before-last read, by other programs than its own.
    def norm_call(splits, rows, dtype=torch.float32, residual_dtype=torch.bfloat16, fp8=False, weighted=True):
        partials = torch.randn(splits, rows, 4096, generator=generator, device=device).to(dtype)
        residual = torch.randn(rows, 4096, generator=shared, device=device).to(residual_dtype)
        weight = ((1 + torch.randn(4096, generator=shared, device=device) / 4).to(residual_dtype) if weighted
                  else None)
        return ("norm", (partials, residual, weight, fp8))

    def tensor_call(shape):
        dtype = torch.float32 if shape[1] == 7 else torch.bfloat16
        return ("gather" if shape[1] == 7 else "sum", torch.randn(shape, generator=generator, device=device).to(dtype))

    calls = [tensor_call((32, 4096)), norm_call(4, 32), tensor_call((1, 4096)), tensor_call((1024, 4096)),
             norm_call(2, 32, dtype=torch.bfloat16), tensor_call((32, 7)), norm_call(4, 32, fp8=True),
             tensor_call((7, 4096)), norm_call(1, 1024, dtype=torch.bfloat16),  # a whole staging half
             norm_call(4, 32, residual_dtype=torch.float32), tensor_call((32, 7)), norm_call(4, 64, weighted=False),
             tensor_call((32, 4096)), norm_call(4, 32, fp8=True), tensor_call((1, 4096))]

    def make(kind, inputs):
        if kind == "norm":
            partials, residual, weight, fp8 = inputs
            return tp.peer.sum_add_rmsnorm(partials, residual, weight, 1e-6, fp8)
        return tp.gather(inputs) if kind == "gather" else tp.all_reduce(inputs)

    originals = [(kind, inputs if kind == "norm" else inputs.clone()) for kind, inputs in calls]
    for kind, inputs in calls:  # every launch compiled before the capture; the calls count alike on both ranks
        make(kind, inputs if kind == "norm" else inputs.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [make(kind, inputs) for kind, inputs in calls]
    before = tp.peer.counts.clone()
    graph.replay()
    agree.append(torch.equal(tp.peer.counts, before + len(calls)))  # every call of the graph over peer memory
    for (kind, x), output in zip(originals, outputs):
        if kind == "gather":
            reference = torch.empty(2 * x.shape[0], x.shape[1], device=device)
            tp.group._allgather_base(reference, x).wait()
            agree.append(torch.equal(output, reference.view(2, *x.shape)))
        elif kind == "sum":
            reference = x.clone()
            tp.group.allreduce([reference]).wait()
            agree.append(torch.equal(output, reference))
        else:
            partials, residual, weight, fp8 = x
            summed = partials[0].float()
            for part in partials[1:]:  # in order, in float32, then rounded to the partials' dtype, as staged
                summed += part.float()
            summed = summed.to(partials.dtype)
            tp.group.allreduce([summed]).wait()
            if fp8:
                (want_q, want_scale), want_residual = fused_add_rmsnorm_fp8(summed, residual, weight, 1e-6)
                (q, scale), residual_out = output
                agree += [torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), torch.equal(scale, want_scale)]
            else:
                want_rows, want_residual = fused_add_rmsnorm(summed, residual, weight, 1e-6)
                rows_out, residual_out = output
                agree.append(torch.equal(rows_out, want_rows))
            agree.append(torch.equal(residual_out, want_residual))
    results[rank] = agree


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs that reach each other's memory")
def test_two_gpus_sum_and_gather_as_nccl_does_eagerly_and_in_graphs():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(minutes=2), wait_for_workers=False)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(gpu_rank, args=(store.port, results), nprocs=2)
    assert dict(results) == {0: [True] * N_CHECKS, 1: [True] * N_CHECKS}
