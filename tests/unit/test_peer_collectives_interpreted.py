"""The one-shot collectives over peer memory (kernels/peer_collectives.py) under Triton's interpreter: the all-reduce
gives every rank the same sum, the rank-order float32 sum rounded once, and the all-gather every rank's tensor in rank
order, call after call and one kind after the other: the flags, the counts and the two staging halves keep ranks that
run ahead from overwriting what another still reads. A row-parallel product's split sums are summed over the splits
in order and then over the ranks, in the same launch.

The ranks are processes (the interpreter runs one kernel at a time in a process) over buffers in shared memory, each
with the addresses it maps them at. tests/kernels/test_peer_collectives_two_gpus.py is the twin on two GPUs."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

PROGRAMS = 3
HALF_SIZE = 7000  # elements of the staging halves, in the test's dtype
# Sizes past what the programs move in one pass (3 x 2048), a single element, and the whole half.
SIZES = [7, 4096, 6145, 1, 2049, HALF_SIZE, 300, 6144 - 1]
# Calls that gather int64 instead, as the greedy step gathers float32 beside bfloat16 sums: another dtype, through
# the same staging buffer and counts.
GATHERS = {3, 6}
# Calls that sum a rank's split sums [S, n] first, as a row-parallel product hands them over: S of them.
SPLITS = {1: 3, 4: 2}


def call_input(call: int, size: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if call in GATHERS:
        return torch.randint(-2**62, 2**62, (size,), generator=generator).share_memory_()
    shape = (SPLITS[call], size) if call in SPLITS else (size,)
    return (torch.randn(shape, generator=generator) * 8).to(dtype).share_memory_()


def rank_share(x: torch.Tensor) -> torch.Tensor:
    """What a rank contributes: x, or its splits summed in order in float32 and rounded to their dtype."""
    if x.dim() == 1:
        return x
    share = x[0].float()
    for split in x[1:]:
        share = share + split.float()
    return share.to(x.dtype)


def assert_equal_after_truncation(out: torch.Tensor, expected: torch.Tensor, shares: list[torch.Tensor]) -> None:
    """Bit for bit in float32. Triton's interpreter truncates float32 to bfloat16 instead of rounding to nearest
    even, so a bfloat16 sum may be one unit in the last place off, and a rank's share of split sums, truncated
    before the ranks' sum, one unit of its own."""
    if out.dtype != torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        bound = expected.float().abs() + sum(share.float().abs() for share in shares)
        assert ((out.float() - expected.float()).abs() <= bound * 2.0**-7).all()


def shared_buffers(world: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's staging buffer and flag array, in shared memory, as an engine's ranks map each other's."""
    return ([torch.zeros(2 * HALF_SIZE, dtype=dtype).share_memory_() for _ in range(world)],
            [torch.zeros(PROGRAMS, world, dtype=torch.int64).share_memory_() for _ in range(world)])


def run_processes(*jobs) -> list[int | None]:
    """Each (function, arguments) job in a process of its own, all at once (under the interpreter, which they
    inherit, whether this process has a GPU or not); their exit codes. One that hangs is killed, so that it cannot
    keep the session waiting at its exit."""
    context = mp.get_context("spawn")
    processes = [context.Process(target=fn, args=args) for fn, args in jobs]
    for process in processes:
        process.start()
    for process in processes:
        process.join(300)
    for process in processes:
        if process.is_alive():
            process.kill()
    return [process.exitcode for process in processes]


def run_ranks(rank_fn, staging: list[torch.Tensor], flags: list[torch.Tensor], *args) -> list[int | None]:
    """`rank_fn(rank, world, staging, flags, *args)` for each rank, as processes (run_processes)."""
    world = len(staging)
    return run_processes(*[(rank_fn, (rank, world, staging, flags, *args)) for rank in range(world)])


def interpreted_rank(rank, world, staging, flags, dtype, inputs, outputs):
    from diffulex_kernels.peer_collectives import one_shot_all_gather, one_shot_all_reduce, one_shot_sum_partials

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
        if call in SPLITS:
            into = one_shot_sum_partials(summed, staging[rank], staging_offsets, flag_ptrs, counts, rank)
            assert into.data_ptr() == summed.data_ptr() and into.shape == out.shape  # over the first split
        else:
            into = one_shot_all_reduce(summed, staging[rank], staging_offsets, flag_ptrs, counts, rank)
            assert into is summed
        out.copy_(into)
    assert counts.tolist() == [len(SIZES)] * PROGRAMS


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_rank_gets_the_rank_order_sum_call_after_call(world, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks inherit it, wherever the suite runs
    generator = torch.Generator().manual_seed(world)
    inputs = [[call_input(call, n, dtype, generator) for call, n in enumerate(SIZES)] for _ in range(world)]
    outputs = [[torch.full((n,), float("nan"), dtype=dtype).share_memory_() for n in SIZES] for _ in range(world)]
    staging, flags = shared_buffers(world, dtype)
    # Each rank checked every gather itself.
    assert run_ranks(interpreted_rank, staging, flags, dtype, inputs, outputs) == [0] * world
    for call in set(range(len(SIZES))) - GATHERS:
        shares = [rank_share(inputs[rank][call]) for rank in range(world)]
        expected = sum(share.float() for share in shares).to(dtype)
        for rank in range(world):
            assert torch.equal(outputs[rank][call], outputs[0][call])  # one sum, whichever rank asks
            assert_equal_after_truncation(outputs[rank][call], expected, shares if call in SPLITS else [])
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


# (split sums, their dtype, the residual's dtype, fp8 rows out) per call of the norm's collective, among all-reduces:
# the split-K partials in float32 before a bf16 residual, cuBLAS's one bf16 product, a float32 model, and a bf16
# product before a float32 residual (the sum is rounded to the product's dtype first, as the all-reduce writes it).
NORM_CALLS = [(3, torch.float32, torch.bfloat16, False), None, (1, torch.bfloat16, torch.bfloat16, True),
              (2, torch.float32, torch.float32, True), (2, torch.float32, torch.bfloat16, True),
              (1, torch.bfloat16, torch.float32, False)]
ROWS, HIDDEN = 5, 96  # more rows than programs, a hidden size under its block


def norm_inputs(world: int) -> list[dict]:
    generator = torch.Generator().manual_seed(17)
    calls = []
    for case in NORM_CALLS:
        if case is None:
            calls.append({"x": [(torch.randn(HIDDEN, generator=generator) * 8).share_memory_() for _ in range(world)]})
            continue
        splits, dtype, residual_dtype, _ = case
        calls.append({
            "partials": [torch.randn(splits, ROWS, HIDDEN, generator=generator).to(dtype).share_memory_()
                         for _ in range(world)],
            "residual": torch.randn(ROWS, HIDDEN, generator=generator).to(residual_dtype).share_memory_(),
            "weight": (1 + torch.randn(HIDDEN, generator=generator) / 4).to(residual_dtype).share_memory_(),
            "out": [torch.zeros(ROWS, HIDDEN, dtype=torch.uint8 if case[3] else residual_dtype).share_memory_()
                    for _ in range(world)],
            "scale": [torch.zeros(ROWS).share_memory_() for _ in range(world)],
            "residual_out": [torch.zeros(ROWS, HIDDEN, dtype=residual_dtype).share_memory_() for _ in range(world)],
            "want_out": torch.zeros(ROWS, HIDDEN, dtype=torch.uint8 if case[3] else residual_dtype).share_memory_(),
            "want_scale": torch.zeros(ROWS).share_memory_(),
            "want_residual": torch.zeros(ROWS, HIDDEN, dtype=residual_dtype).share_memory_(),
        })
    return calls


def norm_rank(rank, world, staging, flags, calls):
    from diffulex_kernels.peer_collectives import one_shot_all_reduce, one_shot_sum_add_rmsnorm

    from diffulex_backend.peer_memory import staging_offset

    staging_offsets = torch.tensor([staging_offset(s, staging[rank]) for s in staging], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    counts = torch.zeros(PROGRAMS, dtype=torch.int64)
    for case, call in zip(NORM_CALLS, calls):
        if case is None:
            one_shot_all_reduce(call["x"][rank], staging[rank].view(torch.float32), staging_offsets, flag_ptrs, counts,
                                rank)
            continue
        partials = call["partials"][rank]
        out, residual_out = one_shot_sum_add_rmsnorm(
            partials, call["residual"], call["weight"], 1e-6, staging[rank].view(partials.dtype), staging_offsets,
            flag_ptrs, counts, rank, fp8=case[3])
        if case[3]:
            (q, scale) = out
            call["out"][rank].copy_(q.view(torch.uint8))
            call["scale"][rank].copy_(scale)
        else:
            call["out"][rank].copy_(out)
        call["residual_out"][rank].copy_(residual_out)
    assert counts.tolist() == [len(NORM_CALLS)] * PROGRAMS


def norm_reference(calls):
    """What every rank should get from each call: the all-reduce's sum, then fused_add_rmsnorm (or
    fused_add_rmsnorm_fp8) of it, written into the call's want_* tensors."""
    from diffulex_kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_fp8

    for case, call in zip(NORM_CALLS, calls):
        if case is None:
            continue
        splits, dtype, _, fp8 = case
        # The all-reduce's sum: each rank's splits in order in float32, rounded to their dtype, then the ranks'.
        shares = [rank_share(partials.view(splits, -1)).view(ROWS, HIDDEN) if splits > 1 else partials[0]
                  for partials in call["partials"]]
        total = sum(share.float() for share in shares)
        # Rounded to their dtype as the interpreter rounds float32 to bfloat16 in a kernel: by truncation.
        total = (total.view(torch.int32) & -65536).view(torch.float32).to(dtype) if dtype == torch.bfloat16 else total
        if fp8:
            (q, scale), residual = fused_add_rmsnorm_fp8(total, call["residual"], call["weight"], 1e-6)
            call["want_out"].copy_(q.view(torch.uint8))
            call["want_scale"].copy_(scale)
        else:
            out, residual = fused_add_rmsnorm(total, call["residual"], call["weight"], 1e-6)
            call["want_out"].copy_(out)
        call["want_residual"].copy_(residual)


@pytest.mark.parametrize("world", [2, 3])
def test_the_norm_s_collective_gives_every_rank_the_norm_of_the_rank_order_sum(world, monkeypatch):
    """A row-parallel product's split sums, summed over the splits and the ranks and then added to the residual and
    normalized in the same launch, give every rank what the all-reduce followed by fused_add_rmsnorm (or
    fused_add_rmsnorm_fp8) gives, bit for bit; and the calls count as the all-reduces beside them do."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = norm_inputs(world)
    assert run_ranks(norm_rank, *shared_buffers(world, torch.float32), calls) == [0] * world
    assert run_processes((norm_reference, (calls,))) == [0]
    for case, call in zip(NORM_CALLS, calls):
        if case is None:
            continue
        for rank in range(world):
            assert torch.equal(call["residual_out"][rank], call["want_residual"]), (case, rank)
            assert torch.equal(call["out"][rank], call["want_out"]), (case, rank)
            if case[3]:
                assert torch.equal(call["scale"][rank], call["want_scale"]), (case, rank)


def wiring_rank(rank, world, staging, flags, calls):
    """The fused forward's `_sum_add_norm` on a rank whose tensor parallelism has peer memory: the same results as
    the kernel's own call (norm_rank), wrapped as the forward takes them."""
    from types import SimpleNamespace

    from diffulex_backend.layers import fused_forward
    from diffulex_backend.peer_memory import PeerCollectives, staging_offset

    peer = PeerCollectives.__new__(PeerCollectives)  # its buffers here are shared memory, not CUDA IPC handles
    peer.rank, peer.timeout_ns, peer.others, peer.open = rank, 60 * 10**9, {}, True
    peer.staging, peer.flags = staging[rank].view(torch.uint8), flags[rank]
    peer.counts = torch.zeros(PROGRAMS, dtype=torch.int64)
    peer.staging_offsets = torch.tensor([staging_offset(s, staging[rank]) for s in staging], dtype=torch.int64)
    peer.flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    tp = SimpleNamespace(size=world, peer=peer)
    for case, call in zip(NORM_CALLS, calls):
        if case is None:
            peer.all_reduce(call["x"][rank])
            continue
        norm = SimpleNamespace(weight=call["weight"], eps=1e-6)
        rows, residual_out = fused_forward._sum_add_norm(tp, call["partials"][rank], call["residual"], norm, case[3])
        if case[3]:
            assert isinstance(rows, fused_forward.Fp8Rows) and rows.dtype == call["residual"].dtype
            call["out"][rank].copy_(rows.q.view(torch.uint8))
            call["scale"][rank].copy_(rows.scale)
        else:
            assert rows.dtype == call["residual"].dtype
            call["out"][rank].copy_(rows)
        call["residual_out"][rank].copy_(residual_out)
    assert peer.counts.tolist() == [len(NORM_CALLS)] * PROGRAMS


def test_the_fused_forward_takes_the_norm_s_collective_where_tensor_parallelism_has_peer_memory(monkeypatch):
    """fused_forward._sum_add_norm, through PeerCollectives.sum_add_rmsnorm, gives each rank what the kernel's own
    call gives (the test above holds that to the all-reduce then the norm), fp8 rows as Fp8Rows of the residual's
    dtype: the wiring the two-GPU test covers on GPUs, here on the CPU with two ranks as processes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    world = 2
    results = []
    for rank_fn in (norm_rank, wiring_rank):
        calls = norm_inputs(world)
        assert run_ranks(rank_fn, *shared_buffers(world, torch.float32), calls) == [0] * world, rank_fn.__name__
        results.append(calls)
    for case, kernel_call, forward_call in zip(NORM_CALLS, *results):
        if case is None:
            continue
        for key in ("out", "scale", "residual_out"):
            for rank in range(world):
                assert torch.equal(forward_call[key][rank], kernel_call[key][rank]), (case, key, rank)
        assert not all(torch.equal(out, torch.zeros_like(out)) for out in forward_call["out"])
