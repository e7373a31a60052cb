"""The batched LoRA delta of a mixed batch in two launches, segmented by adapter (the punica/S-LoRA split): the
kernel twin of `diffulex_backend.layers.lora.add_lora`.

A segment is a run of rows that share an adapter slot: (slot, first row, end row). Rows outside every segment are
neither read nor written.
  shrink:  s[rows]   = x[rows] · A[slot]ᵀ        x [T, K], A [L, R, K]  -> s [T, R] float32
  expand:  out[rows] += s[rows] · B[slot]ᵀ       B [L, N, R]            -> out [T, N], in place
Each program takes one segment's tile of rows and one tile of the output columns, so no two programs write the
same element and the expand needs no atomics. The shrink's result stays in float32 between the two launches
(the torch reference rounds it to the activation dtype).

The grid is (segments, max_rows / BLOCK_M, columns / BLOCK_N): it depends on the number of segments and a bound on
their rows, not on where they lie. A CUDA graph keeps it fixed by passing a table of fixed length, padded with
empty segments (first row = end row, whose programs return at once), and a bound on any segment's rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_for_previous_kernel

BLOCK_M = 16
SHRINK_BLOCK_K = 128  # the shrink walks the whole hidden size: fewer, longer steps
EXPAND_BLOCK_N = 64


@triton.jit
def _segmented_matmul_kernel(in_ptr, w_ptr, out_ptr, seg_ptr, stride_in, stride_w_slot, stride_w_row, stride_out,
                             N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, USE_PDL: tl.constexpr):
    """out[rows, :N] (+)= in[rows, :K] · W[slot]ᵀ over one segment's tile of rows and one tile of N: the shrink
    (W = A, N = rank, stored) and the expand (W = B, K = rank, added to out) are this one product."""
    wait_for_previous_kernel(USE_PDL)
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + 3 * seg).to(tl.int64)
    start = tl.load(seg_ptr + 3 * seg + 1)
    end = tl.load(seg_ptr + 3 * seg + 2)
    first = start + tl.program_id(1) * BLOCK_M
    if first < end:
        rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < end, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(in_ptr + rows[:, None] * stride_in + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + slot * stride_w_slot + cols[None, :] * stride_w_row + ks[:, None],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: W[slot]ᵀ
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        mask = row_mask[:, None] & col_mask[None, :]
        at = out_ptr + rows[:, None] * stride_out + cols[None, :]
        if ACCUMULATE:
            acc += tl.load(at, mask=mask, other=0.0).to(tl.float32)
        tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _rank_block(r: int) -> int:
    """The tile of the rank dimension: all of it in one tile up to 64 (tl.dot needs 16 at least)."""
    return min(64, max(16, triton.next_power_of_2(r)))


def add_lora_segments(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      segments: torch.Tensor, max_rows: int) -> torch.Tensor:
    """out [T, N] += x [T, K] · A[slot]ᵀ · B[slot]ᵀ on each segment's rows, in place; returns out.

    a: [L, R, K], b: [L, N, R]; segments: [S, 3] int32 or int64 on the device, rows (slot, first row, end row),
    where an empty segment (first row = end row) adds nothing; max_rows: at least the longest segment's row
    count. out may be float32 (split-K partial sums) while x is 16-bit."""
    num_segments, (num_tokens, k), r, n = segments.shape[0], x.shape, a.shape[1], b.shape[1]
    if x.stride(-1) != 1 or out.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("add_lora_segments: the last dimension of out, x, a and b must be contiguous")
    if num_segments == 0 or max_rows == 0:
        return out
    segments = segments.contiguous()
    # The dots take float32 operands. tf32 holds a 16-bit activation's mantissa exactly, and the shrunk rows with
    # more bits than the torch reference keeps (it rounds them to the activation dtype), so 16-bit inputs run on
    # tensor cores at no loss against the reference; float32 inputs would lose bits in tf32 and take the exact path.
    precision = "ieee" if x.element_size() >= 4 else "tf32"
    pdl = use_pdl(x)
    shrunk = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)  # [T, R]
    rows, block_r = triton.cdiv(max_rows, BLOCK_M), _rank_block(r)
    _segmented_matmul_kernel[(num_segments, rows, triton.cdiv(r, block_r))](  # shrink: s = x · Aᵀ
        x, a, shrunk, segments, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0), r, k,
        BLOCK_M=BLOCK_M, BLOCK_N=block_r, BLOCK_K=SHRINK_BLOCK_K, PRECISION=precision, ACCUMULATE=False,
        USE_PDL=pdl, launch_pdl=pdl)
    _segmented_matmul_kernel[(num_segments, rows, triton.cdiv(n, EXPAND_BLOCK_N))](  # expand: out += s · Bᵀ
        shrunk, b, out, segments, shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0), n, r,
        BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=block_r, PRECISION=precision, ACCUMULATE=True,
        USE_PDL=pdl, launch_pdl=pdl)
    return out
