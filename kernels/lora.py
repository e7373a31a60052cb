"""The batched LoRA delta of a mixed batch in two launches, segmented by adapter (the punica/S-LoRA split): the
kernel twin of `diffulex_backend.layers.lora.add_lora`.

A segment is a run of rows that share an adapter slot: (slot, first row, end row). Rows outside every segment are
neither read nor written.
  shrink:  s[split, rows] = x[rows, K share] · A[slot, :, K share]ᵀ    x [T, K], A [L, R, K] -> s [P, T, R] float32
  expand:  out[rows]     += (Σ_split s[split, rows]) · B[slot]ᵀ        B [L, N, R]          -> out [T, N], in place
A shrink program takes one segment's tile of rows and one of P shares of K: a segment of a few dozen rows would
otherwise leave most multiprocessors idle while a few walk the whole hidden size. Its P partial sums stay in
float32 and apart, so the result does not depend on any order of atomics; the expand adds them up as it reads
them, or, where its many column tiles would each re-read them, one launch adds them up first, and multiplies their
sum in B's dtype (the torch reference rounds the shrunk rows to the activation dtype too). An expand program takes
one segment's tile of rows and one tile of the output columns, so no two programs write the same element. Weights
are read along their contiguous rank or hidden dimension and transposed in registers, so each load is coalesced.

gate_up's expand has a twin, `silu_and_mul_lora`, folded into the SiLU-and-mul that reads the projection anyway:
its tiles are of all rows, each row taking its own slot (or none), so a tile that spans adapters makes one pass
per slot.

The grids of shrink and expand are (segments, max_rows / BLOCK_M, ...): they depend on the number of segments and a
bound on their rows, not on where they lie. A CUDA graph keeps them fixed by passing a table of fixed length, padded
with empty segments (first row = end row, whose programs return at once), and a bound on any segment's rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dtypes import dot_dtype
from .pdl import use_pdl, wait_for_previous_kernel

BLOCK_K = 128  # the shrink's step along the hidden size
MANY_ROWS = 256  # rows of a grid from which the kernels take tiles of 32 rows (_row_block)
MAX_SPLITS = 8  # the expand reads this many partial sums per element at most
SUM_FIRST_BYTES = 32 << 20  # partial sums an expand may re-read before they are added up once first (_summed)
MIN_PROGRAMS = 264  # two per multiprocessor of an H100: the shrink splits K until it has about that many


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    """acc + a · b. NATIVE: both operands in b's 16-bit dtype, the tensor cores' own input, which halves the
    registers a tile takes (a is rounded to it, as the torch reference rounds the shrunk rows); otherwise in
    float32 at PRECISION."""
    if NATIVE:
        return tl.dot(a.to(b.dtype), b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)


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
                   PRECISION: tl.constexpr, NATIVE: tl.constexpr, USE_PDL: tl.constexpr):
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
            a = tl.load(a_ptr + slot * stride_a_slot + cols[:, None] * stride_a_row + ks[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_K]
            acc = _dot(x, tl.trans(a), acc, PRECISION, NATIVE)
        tl.store(s_ptr + split * stride_s_split + rows[:, None] * stride_s_row + cols[None, :], acc,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, out_ptr, seg_ptr, stride_s_split, stride_s_row, stride_b_slot, stride_b_row,
                   stride_out, N, R, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """out[rows, n tile] += (Σ_split s[split, rows]) · B[slot, n tile]ᵀ."""
    wait_for_previous_kernel(USE_PDL)
    slot, rows, row_mask, any_rows = _segment(seg_ptr, BLOCK_M)
    if any_rows:
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        at = out_ptr + rows[:, None] * stride_out + cols[None, :]
        acc = tl.load(at, mask=mask, other=0.0).to(tl.float32)  # first: its latency overlaps the delta's loads
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_mask = rs < R
            s_mask = row_mask[:, None] & r_mask[None, :]
            s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLITS):
                s += tl.load(s_ptr + split * stride_s_split + rows[:, None] * stride_s_row + rs[None, :], mask=s_mask,
                             other=0.0)
            b = tl.load(b_ptr + slot * stride_b_slot + cols[:, None] * stride_b_row + rs[None, :],
                        mask=col_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
            acc = _dot(s, tl.trans(b), acc, PRECISION, NATIVE)
        tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_lora_kernel(x_ptr, s_ptr, b_ptr, slot_ptr, out_ptr, stride_x, stride_s_split, stride_s_row,
                              stride_b_slot, stride_b_row, stride_out, T, size, R, SPLITS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                              PRECISION: tl.constexpr, NATIVE: tl.constexpr, USE_PDL: tl.constexpr):
    """out[rows, n tile] = silu(gate + Δgate) * (up + Δup), Δ = (Σ_split s[split, row]) · B[row's slot]ᵀ."""
    wait_for_previous_kernel(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < T
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < size
    mask = row_mask[:, None] & col_mask[None, :]
    at = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + size, mask=mask, other=0.0).to(tl.float32)
    slots = tl.load(slot_ptr + rows, mask=row_mask, other=-1)
    # The tile's rows may span several adapters (a request's rows start anywhere): one pass per slot in the
    # tile's range, each adding to its own rows only; a tile of no adapter row makes no pass.
    first = tl.min(tl.where(slots >= 0, slots, 2 ** 30), axis=0).to(tl.int64)  # int64: slot * stride below
    for slot in range(first, tl.max(slots, axis=0).to(tl.int64) + 1):
        chosen = slots == slot
        # A slot between the tile's first and last that none of its rows takes reads nothing.
        for r0 in range(0, tl.where(tl.max(chosen.to(tl.int32), axis=0) > 0, R, 0), BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_mask = rs < R
            s_mask = chosen[:, None] & r_mask[None, :]
            s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLITS):
                s += tl.load(s_ptr + split * stride_s_split + rows[:, None] * stride_s_row + rs[None, :], mask=s_mask,
                             other=0.0)
            b_at = b_ptr + slot * stride_b_slot + cols[:, None] * stride_b_row + rs[None, :]
            b_mask = col_mask[:, None] & r_mask[None, :]
            b_gate = tl.load(b_at, mask=b_mask, other=0.0)  # [BLOCK_N, BLOCK_R]
            b_up = tl.load(b_at + size * stride_b_row, mask=b_mask, other=0.0)
            gate = _dot(s, tl.trans(b_gate), gate, PRECISION, NATIVE)
            up = _dot(s, tl.trans(b_up), up, PRECISION, NATIVE)
    # Rounded where the torch modules round: the adapted projection's output, then the SiLU (activation.py).
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], (silu * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def _native_dots(weights: torch.Tensor) -> bool:
    """Whether the dots take 16-bit operands as they are (`_dot`): where `dot_dtype` keeps the weights' own dtype
    (a GPU), not under the interpreter, which multiplies 16-bit dots wrongly."""
    return dot_dtype(weights) != tl.float32


def _rank_block(r: int) -> int:
    """The tile of the rank dimension: all of it in one tile up to 64 (tl.dot needs 16 at least)."""
    return min(64, max(16, triton.next_power_of_2(r)))


def _row_block(rows: int) -> int:
    """Rows per program, for a grid over `rows` rows: 32 once they are many (a batch of blocks), where the wider
    tile halves how often A and B are read; 16 for a few, where more programs keep more multiprocessors busy."""
    return 32 if rows >= MANY_ROWS else 16


def shrink(x: torch.Tensor, a: torch.Tensor, segments: torch.Tensor, max_rows: int) -> torch.Tensor:
    """x [T, K] · A[slot]ᵀ on each segment's rows: float32 partial sums [P, T, R] whose sum over P is the product.
    Rows of no segment are left unwritten. a: [L, R, K]; segments and max_rows as for add_lora_segments."""
    num_segments, (num_tokens, k), r = segments.shape[0], x.shape, a.shape[1]
    if x.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError("lora shrink: the last dimension of x and a must be contiguous")
    if num_segments == 0 or max_rows == 0:  # no row to shrink: nothing reads these
        return torch.zeros(1, num_tokens, r, dtype=torch.float32, device=x.device)
    segments = segments.contiguous()
    # 16-bit inputs multiply as they are (`_dot`), or under the interpreter in float32 at tf32, which holds their
    # mantissa exactly; float32 inputs would lose bits in tf32 and take the exact path.
    precision = "ieee" if x.element_size() >= 4 else "tf32"
    pdl = use_pdl(x)
    block_m, block_r = _row_block(num_segments * max_rows), _rank_block(r)
    row_tiles = triton.cdiv(max_rows, block_m)
    tiles = num_segments * row_tiles * triton.cdiv(r, block_r)
    splits = max(1, min(MAX_SPLITS, triton.cdiv(k, BLOCK_K), MIN_PROGRAMS // tiles))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)  # no share left empty
    shrunk = torch.empty(splits, num_tokens, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_segments, row_tiles, triton.cdiv(r, block_r) * splits)](
        x, a, shrunk, segments, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0), shrunk.stride(1), r, k,
        k_per_split, splits, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=BLOCK_K, PRECISION=precision,
        NATIVE=_native_dots(a), USE_PDL=pdl,
        launch_pdl=pdl)
    return shrunk


def _summed(shrunk: torch.Tensor, rows: int, column_tiles: int) -> torch.Tensor:
    """The partial sums, or their sum over P when the reader's column tiles, each reading every partial sum of its
    rows, would read more than SUM_FIRST_BYTES of them: then one launch adds them up first (deterministic, unlike
    atomics). Rows of no segment hold garbage either way and are never read."""
    splits, _, r = shrunk.shape
    if splits > 1 and column_tiles * splits * rows * r * shrunk.element_size() > SUM_FIRST_BYTES:
        return shrunk.sum(0, keepdim=True)
    return shrunk


def expand(out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, segments: torch.Tensor,
           max_rows: int) -> torch.Tensor:
    """out [T, N] += (Σ_P shrunk[P]) · B[slot]ᵀ on each segment's rows, in place; returns out. b: [L, N, R]."""
    num_segments, n, r = segments.shape[0], b.shape[1], b.shape[2]
    if out.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("lora expand: the last dimension of out and b must be contiguous")
    if num_segments == 0 or max_rows == 0:
        return out
    segments = segments.contiguous()
    precision = "ieee" if b.element_size() >= 4 else "tf32"  # as the shrink's, by the weights' dtype
    pdl = use_pdl(out)
    block_m, block_r = _row_block(num_segments * max_rows), _rank_block(r)
    # Wide column tiles where the row tiles are few (a small batch), so each program streams more of B; narrower
    # where 32-row tiles already give many programs (docs/kernels.md, "LoRA delta").
    block_n = 128 if block_m == 32 else 256
    shrunk = _summed(shrunk, num_segments * max_rows, triton.cdiv(n, block_n))
    _expand_kernel[(num_segments, triton.cdiv(max_rows, block_m), triton.cdiv(n, block_n))](
        shrunk, b, out, segments, shrunk.stride(0), shrunk.stride(1), b.stride(0), b.stride(1), out.stride(0), n, r,
        SPLITS=shrunk.shape[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=precision,
        NATIVE=_native_dots(b),
        USE_PDL=pdl, launch_pdl=pdl)
    return out


def add_lora_segments(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      segments: torch.Tensor, max_rows: int) -> torch.Tensor:
    """out [T, N] += x [T, K] · A[slot]ᵀ · B[slot]ᵀ on each segment's rows, in place; returns out.

    a: [L, R, K], b: [L, N, R]; segments: [S, 3] int32 or int64 on the device, rows (slot, first row, end row),
    where an empty segment (first row = end row) adds nothing; max_rows: at least the longest segment's row
    count. out may be float32 (split-K partial sums) while x is 16-bit."""
    return expand(out, shrink(x, a, segments, max_rows), b, segments, max_rows)


def silu_and_mul_lora(gate_up: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor,
                      row_slots: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the adapted gate_up projection, its expand folded in: gate_up [T, 2I] is the base
    product, shrunk [P, T, R] the shrink of its input (`shrink`), b [L, 2I, R] the stack's B, row_slots [T] each
    row's slot (-1: none). The adapted output is read once, for the SiLU, rather than written and read again."""
    num_tokens, width = gate_up.shape
    size, r = width // 2, b.shape[2]
    if gate_up.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("silu_and_mul_lora: the last dimension of gate_up and b must be contiguous")
    if b.shape[1] != width or shrunk.shape[1:] != (num_tokens, r) or row_slots.shape != (num_tokens,):
        raise ValueError(f"silu_and_mul_lora: gate_up {tuple(gate_up.shape)}, shrunk {tuple(shrunk.shape)}, "
                         f"b {tuple(b.shape)} and row_slots {tuple(row_slots.shape)} do not fit one another")
    out = torch.empty(num_tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    pdl = use_pdl(gate_up)
    block_m = _row_block(num_tokens)
    # The other way round from the expand's: at 32-row tiles each program also loads gate and up tiles, which
    # wider column tiles amortise; at small batches narrower tiles give more programs (docs/kernels.md).
    block_n = 256 if block_m == 32 else 128
    shrunk = _summed(shrunk, num_tokens, triton.cdiv(size, block_n))
    _silu_and_mul_lora_kernel[(triton.cdiv(num_tokens, block_m), triton.cdiv(size, block_n))](
        gate_up, shrunk, b, row_slots, out, gate_up.stride(0), shrunk.stride(0), shrunk.stride(1), b.stride(0),
        b.stride(1), out.stride(0), num_tokens, size, r, SPLITS=shrunk.shape[0], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=_rank_block(r), PRECISION="ieee" if b.element_size() >= 4 else "tf32", NATIVE=_native_dots(b),
        USE_PDL=pdl, launch_pdl=pdl)
    return out
