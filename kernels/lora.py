"""The batched LoRA delta of a mixed batch in two launches, segmented by adapter (the punica/S-LoRA split): the
kernel twin of `diffulex_backend.layers.lora.add_lora`.

A segment is a run of rows that share an adapter slot: (slot, first row, end row). Rows outside every segment are
neither read nor written.
  shrink:  s[split, rows] = x[rows, K share] · A[slot, :, K share]ᵀ    x [T, K], A [L, R, K] -> s [P, T, R] float32
  expand:  out[rows]     += (Σ_split s[split, rows]) · B[slot]ᵀ        B [L, N, R]          -> out [T, N], in place
A shrink program takes one segment's tile of rows and one of P shares of K: a segment of a few dozen rows would
otherwise leave most multiprocessors idle while a few walk the whole hidden size. Its P partial sums stay in
float32 and apart; the expand adds them up as it reads them, so the result does not depend on any order of
atomics (the torch reference rounds the shrunk rows to the activation dtype). An expand program takes one
segment's tile of rows and one tile of the output columns, so no two programs write the same element.

The grids are (segments, max_rows / BLOCK_M, ...): they depend on the number of segments and a bound on their rows,
not on where they lie. A CUDA graph keeps them fixed by passing a table of fixed length, padded with empty segments
(first row = end row, whose programs return at once), and a bound on any segment's rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_for_previous_kernel

BLOCK_M = 16
BLOCK_K = 128  # the shrink's step along the hidden size
BLOCK_N = 64  # the expand's tile of output columns
MAX_SPLITS = 8  # the expand reads this many partial sums per element at most
MIN_PROGRAMS = 264  # two per multiprocessor of an H100: the shrink splits K until it has about that many


@triton.jit
def _segment(seg_ptr, BLOCK_M: tl.constexpr):
    """This program's segment: (slot, its rows of this program's tile, mask of them, whether any)."""
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + 3 * seg).to(tl.int64)
    start = tl.load(seg_ptr + 3 * seg + 1)
    end = tl.load(seg_ptr + 3 * seg + 2)
    first = start + tl.program_id(1) * BLOCK_M
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    return slot, rows, rows < end, first < end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, seg_ptr, stride_x, stride_a_slot, stride_a_row, stride_s_split, stride_s_row,
                   R, K, k_per_split, splits, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """s[split, rows, r tile] = x[rows, K share] · A[slot, r tile, K share]ᵀ."""
    wait_for_previous_kernel(USE_PDL)
    slot, rows, row_mask, any_rows = _segment(seg_ptr, BLOCK_M)
    if any_rows:
        split, r_tile = tl.program_id(2) % splits, tl.program_id(2) // splits
        cols = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
        col_mask = cols < R
        k_end = tl.minimum(K, (split + 1) * k_per_split)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(split * k_per_split, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            a = tl.load(a_ptr + slot * stride_a_slot + cols[None, :] * stride_a_row + ks[:, None],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]: A[slot]ᵀ
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=PRECISION)
        tl.store(s_ptr + split * stride_s_split + rows[:, None] * stride_s_row + cols[None, :], acc,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, out_ptr, seg_ptr, stride_s_split, stride_s_row, stride_b_slot, stride_b_row,
                   stride_out, N, R, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """out[rows, n tile] += (Σ_split s[split, rows]) · B[slot, n tile]ᵀ."""
    wait_for_previous_kernel(USE_PDL)
    slot, rows, row_mask, any_rows = _segment(seg_ptr, BLOCK_M)
    if any_rows:
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_mask = rs < R
            s_mask = row_mask[:, None] & r_mask[None, :]
            s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLITS):
                s += tl.load(s_ptr + split * stride_s_split + rows[:, None] * stride_s_row + rs[None, :], mask=s_mask,
                             other=0.0)
            b = tl.load(b_ptr + slot * stride_b_slot + cols[None, :] * stride_b_row + rs[:, None],
                        mask=r_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B[slot]ᵀ
            acc = tl.dot(s, b.to(tl.float32), acc, input_precision=PRECISION)
        mask = row_mask[:, None] & col_mask[None, :]
        at = out_ptr + rows[:, None] * stride_out + cols[None, :]
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
    row_tiles, block_r = triton.cdiv(max_rows, BLOCK_M), _rank_block(r)
    tiles = num_segments * row_tiles * triton.cdiv(r, block_r)
    splits = max(1, min(MAX_SPLITS, triton.cdiv(k, BLOCK_K), MIN_PROGRAMS // tiles))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)  # no share left empty
    shrunk = torch.empty(splits, num_tokens, r, dtype=torch.float32, device=x.device)  # [P, T, R]
    _shrink_kernel[(num_segments, row_tiles, triton.cdiv(r, block_r) * splits)](
        x, a, shrunk, segments, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0), shrunk.stride(1), r, k,
        k_per_split, splits, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, PRECISION=precision, USE_PDL=pdl,
        launch_pdl=pdl)
    _expand_kernel[(num_segments, row_tiles, triton.cdiv(n, BLOCK_N))](
        shrunk, b, out, segments, shrunk.stride(0), shrunk.stride(1), b.stride(0), b.stride(1), out.stride(0), n, r,
        SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r, PRECISION=precision, USE_PDL=pdl,
        launch_pdl=pdl)
    return out
