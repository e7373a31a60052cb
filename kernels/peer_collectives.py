"""A one-shot all-reduce and all-gather over peer memory: each rank reads every other rank's share straight from its
GPU.

For the small sums a tensor-parallel decode step makes (a block of rows times the hidden size, two per layer) a
ring all-reduce is bound by its latency: a few steps of a protocol, each a round trip. Between GPUs that map each
other's memory (NVLink, or PCIe with peer access) one launch does it:

1. each program copies its chunks of the rank's partial into the rank's staging buffer (summing them first, in
   float32, when the rank's partial comes as the split sums of a row-parallel product);
2. it raises its flag in every rank's flag array (a release store at system scope) and waits until every rank's
   same program has raised its own (acquire loads);
3. it sums its chunks over every rank's staging buffer, in float32 and in rank order, so every rank rounds the same
   sum, and writes them over the partial; or, gathering, copies every rank's chunks into the output, rank 0's
   first.
`one_shot_sum_add_rmsnorm` takes whole rows instead of chunks, and its third step ends in each row's residual-add
norm (norm.py) instead of a write of the sum.

Programs synchronise pairwise with the same program of the other ranks and never with one another, so a launch
cannot wait on a program of its own grid that has not been scheduled. The flags hold a count of calls (int64: it
never wraps), which each program keeps in `counts`; every rank makes the same calls in the same order, so the
counts agree. The staging buffer has two halves used in turn: a rank writes a half again only two calls later,
after every rank has raised its flag for the call between, which it does only once it has read that half.

Every rank passes the same `programs` (the length of `counts`), for every call: a program's flags and count are its
own.

A rank that never arrives (its process died mid-step) would keep the others waiting for good: on a GPU a program
that has waited `timeout_ns` fails the launch with a device-side assertion, as a collective that times out fails,
and the engine's next read-back raises.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dtypes import triton_dtype
from .norm import FP8, add_rmsnorm_row, norm_warps
from .pdl import use_pdl, wait_for_previous_kernel

BLOCK = 2048  # elements a program moves per chunk


@triton.jit
def _staging(staging_ptr, staging_offsets, rank, half):
    """Rank `rank`'s staging half, as an offset from this rank's buffer: a table of 16-byte units, multiplied back
    here, keeps the compiler's knowledge that the buffer is 16-byte aligned, so a thread moves 16 bytes a load."""
    dtype = staging_ptr.dtype.element_ty
    return staging_ptr + tl.load(staging_offsets + rank) * (16 // (dtype.primitive_bitwidth // 8)) + half


@triton.jit
def _share(x_ptr, index, mask, n, NUM_PARTIALS: tl.constexpr):
    """This rank's share at `index`: x's values, or with NUM_PARTIALS > 1 the sum of x's NUM_PARTIALS split sums
    (each n long), in order and in float32, as the residual-add norm adds them up on one rank."""
    share = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, NUM_PARTIALS):
        share += tl.load(x_ptr + part * n + index, mask=mask, other=0.0).to(tl.float32)
    return share


@triton.jit
def _sum_over_ranks(staging_ptr, staging_offsets, half, index, mask, WORLD: tl.constexpr):
    """Step 3's sum at `index` over every rank's staging half, in float32 and in rank order, so every rank rounds
    the same sum."""
    total = tl.zeros(index.shape, dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        staging = _staging(staging_ptr, staging_offsets, peer, half)
        total += tl.load(staging + index, mask=mask, other=0.0).to(tl.float32)
    return total


@triton.jit
def _arrive_and_wait(counts_ptr, flag_ptrs, program, rank, count, timeout_ns, WORLD: tl.constexpr,
                     TIMED: tl.constexpr):
    """Step 2: this program's call `count` staged here, raised in every rank's flags, and waited for from every
    rank's same program."""
    # Every thread's copy is done before the flag says so; the release makes the copies visible with it. Every
    # thread has read the count, too, before it is written: a warp that read it after the write would take the
    # other half, and wait for a call the other ranks have not made.
    tl.debug_barrier()
    tl.store(counts_ptr + program, count)
    slot = program * WORLD
    for peer in tl.static_range(WORLD):
        flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flags + slot + rank, count, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    if TIMED:
        deadline = tl.extra.cuda.globaltimer() + timeout_ns
    for peer in tl.static_range(WORLD):
        # A rank may be a call ahead (its flag then already says count + 1), never behind once it has arrived.
        while tl.atomic_add(own_flags + slot + peer, 0, sem="acquire", scope="sys") < count:
            if TIMED:
                tl.device_assert(tl.extra.cuda.globaltimer() < deadline,
                                 "one-shot collective: a rank did not arrive in time")
    tl.debug_barrier()


@triton.jit(debug=True)  # keeps the device assertion of the timeout
def _one_shot_collective(x_ptr, out_ptr, staging_ptr, staging_offsets, flag_ptrs, counts_ptr, n, half_size, rank,
                         timeout_ns, WORLD: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                         NUM_PARTIALS: tl.constexpr, TIMED: tl.constexpr, USE_PDL: tl.constexpr):
    """Sums x into out (x itself, in place), or with GATHER writes every rank's x into out ([WORLD, n]).
    With NUM_PARTIALS > 1, x is [NUM_PARTIALS, n], this rank's share is their sum, and out is x[0].
    staging_ptr: this rank's staging buffer ([2, half_size] of x's dtype); staging_offsets: int64 [WORLD], where
    every rank's starts from it, in 16-byte units; flag_ptrs: int64 [WORLD], the addresses of every rank's flag
    array (int64 [programs, WORLD]); counts_ptr: int64 [programs], this rank's."""
    wait_for_previous_kernel(USE_PDL)
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    count = tl.load(counts_ptr + program) + 1
    half = (count % 2) * half_size
    offsets = tl.arange(0, BLOCK)
    chunks = tl.cdiv(n, BLOCK)
    for chunk in range(program, chunks, programs):
        index = chunk * BLOCK + offsets
        mask = index < n
        if NUM_PARTIALS > 1:
            share = _share(x_ptr, index, mask, n, NUM_PARTIALS)
            tl.store(staging_ptr + half + index, share.to(staging_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(staging_ptr + half + index, tl.load(x_ptr + index, mask=mask), mask=mask)
    _arrive_and_wait(counts_ptr, flag_ptrs, program, rank, count, timeout_ns, WORLD, TIMED)
    for chunk in range(program, chunks, programs):
        index = chunk * BLOCK + offsets
        mask = index < n
        if GATHER:
            for peer in tl.static_range(WORLD):
                staging = _staging(staging_ptr, staging_offsets, peer, half)
                tl.store(out_ptr + peer * n + index, tl.load(staging + index, mask=mask), mask=mask)
        else:
            total = _sum_over_ranks(staging_ptr, staging_offsets, half, index, mask, WORLD)
            tl.store(out_ptr + index, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(debug=True)  # keeps the device assertion of the timeout
def _one_shot_add_rmsnorm(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, staging_ptr,
                          staging_offsets, flag_ptrs, counts_ptr, num_rows, hidden_size, half_size, rank, timeout_ns,
                          eps, WORLD: tl.constexpr, BLOCK: tl.constexpr, NUM_PARTIALS: tl.constexpr,
                          FP8_OUT: tl.constexpr, ACT_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                          TIMED: tl.constexpr, USE_PDL: tl.constexpr):
    """The collective's three steps by whole rows, each program its own rows, the third ending in the residual-add
    norm (norm.py's add_rmsnorm_row) instead of a write of the sum: x [NUM_PARTIALS, num_rows, hidden_size] is this
    rank's split sums; residual, out and residual_out are [num_rows, hidden_size], contiguous.

    Programs own rows here and chunks in _one_shot_collective, and the two kinds of call share the staging halves
    and counts: a half is safe to write again all the same, since a rank's program arrives at a call only inside
    that call's launch, which starts once the rank's previous launch has ended (wait_for_previous_kernel)."""
    wait_for_previous_kernel(USE_PDL)
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    count = tl.load(counts_ptr + program) + 1
    half = (count % 2) * half_size
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    n = num_rows * hidden_size
    for row in range(program, num_rows, programs):
        index = row * hidden_size + cols
        share = _share(x_ptr, index, mask, n, NUM_PARTIALS)
        tl.store(staging_ptr + half + index, share.to(staging_ptr.dtype.element_ty), mask=mask)
    _arrive_and_wait(counts_ptr, flag_ptrs, program, rank, count, timeout_ns, WORLD, TIMED)
    for row in range(program, num_rows, programs):
        index = row * hidden_size + cols
        total = _sum_over_ranks(staging_ptr, staging_offsets, half, index, mask, WORLD)
        # Rounded to x's dtype, as the all-reduce writes its sum for the norm after it.
        add_rmsnorm_row(total.to(x_ptr.dtype.element_ty), row, cols, mask, residual_ptr, weight_ptr, out_ptr,
                        residual_out_ptr, scale_ptr, stride_residual=hidden_size, stride_out=hidden_size,
                        stride_residual_out=hidden_size, hidden_size=hidden_size, eps=eps, ADD_RESIDUAL=True,
                        FP8_OUT=FP8_OUT, ACT_DTYPE=ACT_DTYPE, HAS_WEIGHT=HAS_WEIGHT)


def one_shot_sum_add_rmsnorm(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             staging: torch.Tensor, staging_offsets: torch.Tensor, flag_ptrs: torch.Tensor,
                             counts: torch.Tensor, rank: int, timeout_ns: int = 0, fp8: bool = False):
    """partials [S, T, hidden] (contiguous) summed over S and over the ranks, added to residual [T, hidden] and
    normalized, in one launch: (out, residual_out) as fused_add_rmsnorm(the sum, residual, weight, eps) gives them,
    or with `fp8` ((q, scale), residual_out) as fused_add_rmsnorm_fp8's. The buffers as one_shot_all_reduce takes
    them, and a call counts as one of its calls."""
    num_partials, num_rows, hidden_size = partials.shape
    half_size = staging.numel() // 2
    assert partials.is_contiguous() and residual.is_contiguous() and num_rows * hidden_size <= half_size
    assert staging.dtype == partials.dtype and residual.shape == (num_rows, hidden_size)
    out = torch.empty(residual.shape, dtype=FP8 if fp8 else residual.dtype, device=residual.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=residual.device) if fp8 else out
    residual_out = torch.empty_like(residual)
    pdl = use_pdl(partials)
    _one_shot_add_rmsnorm[(counts.numel(),)](
        partials, residual, residual if weight is None else weight, out, residual_out, scale, staging,
        staging_offsets, flag_ptrs, counts, num_rows, hidden_size, half_size, rank, timeout_ns, eps,
        WORLD=staging_offsets.numel(), BLOCK=triton.next_power_of_2(hidden_size), NUM_PARTIALS=num_partials,
        FP8_OUT=fp8,
        # What the norm kernel passes: the dtype is read only to round the rows before their cast.
        ACT_DTYPE=triton_dtype(residual.dtype) if fp8 else tl.float32, HAS_WEIGHT=weight is not None,
        TIMED=partials.is_cuda and timeout_ns > 0, USE_PDL=pdl, launch_pdl=pdl,
        # The norm kernel's warps, which order a row's sums: the same bits as the all-reduce, then the norm.
        num_warps=norm_warps(hidden_size, fp8, num_rows))
    return ((out, scale) if fp8 else out), residual_out


def one_shot_all_reduce(x: torch.Tensor, staging: torch.Tensor, staging_offsets: torch.Tensor,
                        flag_ptrs: torch.Tensor, counts: torch.Tensor, rank: int, timeout_ns: int = 0) -> torch.Tensor:
    """Sums x (contiguous, at most half of `staging`) over the ranks, in place; returns x.
    - staging: this rank's staging buffer, of x's dtype, 16-byte aligned, as large as every other rank's;
    - staging_offsets: int64 [world], where each rank's staging buffer starts, from this one's, in 16-byte units;
    - flag_ptrs: int64 [world], the addresses of every rank's flag array (int64 [len(counts), world], zeros at
      first);
    - counts: int64 [programs], this rank's, zeros at first;
    - timeout_ns > 0 bounds the wait for the other ranks on a GPU (the interpreter waits without bound)."""
    _launch(x, x, False, staging, staging_offsets, flag_ptrs, counts, rank, timeout_ns)
    return x


def one_shot_sum_partials(partials: torch.Tensor, staging: torch.Tensor, staging_offsets: torch.Tensor,
                          flag_ptrs: torch.Tensor, counts: torch.Tensor, rank: int, timeout_ns: int = 0) -> torch.Tensor:
    """partials [S, *shape] (contiguous): their sum over S and over the ranks, written over partials[0], which it
    returns. One launch where one_shot_all_reduce(partials.sum(0)) takes two; the buffers as it takes them."""
    _launch(partials, partials[0], False, staging, staging_offsets, flag_ptrs, counts, rank, timeout_ns,
            partials.shape[0])
    return partials[0]


def one_shot_all_gather(x: torch.Tensor, staging: torch.Tensor, staging_offsets: torch.Tensor,
                        flag_ptrs: torch.Tensor, counts: torch.Tensor, rank: int, timeout_ns: int = 0) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, rank 0's first. The buffers as one_shot_all_reduce takes them, and the
    same ones serve both: a call of either is one of the counted calls."""
    out = torch.empty((staging_offsets.numel(), *x.shape), dtype=x.dtype, device=x.device)
    _launch(x, out, True, staging, staging_offsets, flag_ptrs, counts, rank, timeout_ns)
    return out


def _launch(x, out, gather, staging, staging_offsets, flag_ptrs, counts, rank, timeout_ns, num_partials=1):
    half_size = staging.numel() // 2
    n = x.numel() // num_partials
    assert x.is_contiguous() and n <= half_size and staging.dtype == x.dtype
    pdl = use_pdl(x)
    _one_shot_collective[(counts.numel(),)](
        x, out, staging, staging_offsets, flag_ptrs, counts, n, half_size, rank, timeout_ns,
        WORLD=staging_offsets.numel(), BLOCK=BLOCK, GATHER=gather, NUM_PARTIALS=num_partials,
        TIMED=x.is_cuda and timeout_ns > 0, USE_PDL=pdl, num_warps=8, launch_pdl=pdl)
