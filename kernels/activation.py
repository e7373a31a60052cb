"""SiLU-and-mul of the gated MLP in one pass: the kernel twin of `silu(gate) * up` on the fused gate_up output.

The SiLU is rounded to the activation dtype before the product, as the two separate torch ops round it, so the
kernel reproduces the reference up to the last bit of the exponential.

`silu_and_mul_fp8` writes the product as the input of an FP8 down projection (kernels/fp8.py): one program a row,
which holds the whole row, rounds it to the activation dtype and casts it to float8_e4m3fn with the row's scale, as
`quantize_rows(silu_and_mul(...))` would, bit for bit, without the 16-bit round trip or the second launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dtypes import triton_dtype
from .pdl import use_pdl, wait_for_previous_kernel

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] with rows [gate; up] -> silu(gate) * up: [T, I]."""
    num_tokens, width = gate_up.shape
    size = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul: the feature dimension must be contiguous")
    out = torch.empty(num_tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=BLOCK, USE_PDL=use_pdl(gate_up), num_warps=4,
        launch_pdl=use_pdl(gate_up),
    )
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, size, BLOCK: tl.constexpr,
                             ACT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(ACT_DTYPE).to(tl.float32)
    h = (silu * up).to(ACT_DTYPE).to(tl.float32)
    # As quantize_rows casts a row (kernels/fp8.py).
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(h), axis=0), 448.0), 1.1754943508222875e-38)
    q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale), -448.0), 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2 * I] -> (q [T, I] float8_e4m3fn, scale [T] float32): silu(gate) * up cast per row."""
    num_tokens, width = gate_up.shape
    size = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul_fp8: the feature dimension must be contiguous")
    q = torch.empty(num_tokens, size, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=gate_up.device)
    if num_tokens == 0:
        return q, scale
    block = triton.next_power_of_2(size)
    _silu_and_mul_fp8_kernel[(num_tokens,)](
        gate_up, q, scale, gate_up.stride(0), q.stride(0), size, BLOCK=block,
        ACT_DTYPE=triton_dtype(gate_up.dtype), USE_PDL=use_pdl(gate_up), launch_pdl=use_pdl(gate_up),
        num_warps=min(16, max(4, block // 1024)),
    )
    return q, scale
