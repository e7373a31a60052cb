"""SiLU-and-mul of the gated MLP in one pass: the kernel twin of `silu(gate) * up` on the fused gate_up output.

The SiLU is rounded to the activation dtype before the product, as the two separate torch ops round it, so the
kernel reproduces the reference up to the last bit of the exponential.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
