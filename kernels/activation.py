"""SiLU-and-mul of the gated MLP in one pass: the kernel twin of `silu(gate) * up` on the fused gate_up output.

The SiLU is rounded to the activation dtype before the product, as the two separate torch ops round it, so the
kernel reproduces the reference up to the last bit of the exponential.

`silu_and_mul_fp8` writes the product as the input of an FP8 down projection (kernels/fp8.py), in two launches that
both spread a row over many programs: the first writes silu(gate) * up in the activation dtype with the largest
magnitude of each chunk of it, the second casts each chunk to float8_e4m3fn with the row's scale, the largest of its
chunks' over 448. Its result is `quantize_rows(silu_and_mul(...))` bit for bit: a maximum does not depend on the
order it is taken in. A row held whole by one program would make it one launch, but at a decode step's few rows
that leaves most of the GPU idle: at 32 rows of LLaDA-8B's width the two launches take half its time
(benchmarks/fp8.py's casts section; docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_cast import abs_max, cast_to_fp8_range, nan_max, row_scale
from .pdl import use_pdl, wait_for_previous_kernel

BLOCK = 1024


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from float32 gate and up values of `dtype`, rounded as the two torch ops round: the SiLU to
    dtype, then the product to dtype. The SiLU-and-mul kernel and the fp8 gate_up product's epilogue share it."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, amax_ptr, stride_x, stride_out, size, num_chunks, BLOCK: tl.constexpr,
                         CHUNK_AMAX: tl.constexpr, USE_PDL: tl.constexpr):
    """CHUNK_AMAX: amax_ptr [rows, num_chunks] gets the largest magnitude of each chunk of BLOCK columns written."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    h = silu_times_up(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, h, mask=mask)
    if CHUNK_AMAX:
        tl.store(amax_ptr + row * num_chunks + chunk, abs_max(h.to(tl.float32), 0))


def _launch(gate_up: torch.Tensor, out: torch.Tensor, chunk_amax: torch.Tensor | None) -> None:
    num_tokens, size = out.shape
    if num_tokens == 0:
        return
    pdl = use_pdl(gate_up)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, BLOCK))](
        gate_up, out, out if chunk_amax is None else chunk_amax, gate_up.stride(0), out.stride(0), size,
        triton.cdiv(size, BLOCK), BLOCK=BLOCK, CHUNK_AMAX=chunk_amax is not None, USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] with rows [gate; up] -> silu(gate) * up: [T, I]."""
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul: the feature dimension must be contiguous")
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    _launch(gate_up, out, None)
    return out


@triton.jit
def _cast_chunks_kernel(h_ptr, amax_ptr, q_ptr, scale_ptr, stride_h, stride_q, size, num_chunks, BLOCK: tl.constexpr,
                        CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    """Casts BLOCK columns of a row with the row's scale, from the largest magnitudes of its num_chunks chunks
    (amax_ptr [rows, num_chunks], chunks of any width)."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.arange(0, CHUNKS)
    # As quantize_rows casts a row (kernels/fp8.py).
    scale = row_scale(nan_max(tl.load(amax_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0), 0))
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * stride_q + cols, cast_to_fp8_range(h, scale).to(q_ptr.dtype.element_ty), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2 * I] -> (q [T, I] float8_e4m3fn, scale [T] float32): silu(gate) * up cast per row."""
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul_fp8: the feature dimension must be contiguous")
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(num_tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    chunk_amax = torch.empty(num_tokens, triton.cdiv(size, BLOCK), dtype=torch.float32, device=gate_up.device)
    _launch(gate_up, h, chunk_amax)
    return cast_chunks(h, chunk_amax)


def cast_chunks(h: torch.Tensor, chunk_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, I] and the largest magnitude of each of its rows' chunks ([T, C], chunks of any width, written with
    h) -> (q [T, I] float8_e4m3fn, scale [T] float32): each row cast with its scale, as quantize_rows casts it, in
    one launch spread over chunks of BLOCK columns."""
    num_tokens, size = h.shape
    q = torch.empty(num_tokens, size, dtype=torch.float8_e4m3fn, device=h.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=h.device)
    if num_tokens == 0:
        return q, scale
    pdl = use_pdl(h)
    _cast_chunks_kernel[(num_tokens, triton.cdiv(size, BLOCK))](
        h, chunk_amax, q, scale, h.stride(0), q.stride(0), size, chunk_amax.shape[1], BLOCK=BLOCK,
        CHUNKS=triton.next_power_of_2(chunk_amax.shape[1]), USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
    )
    return q, scale
