"""Rotary position embedding applied in place: the kernel twin of `diffulex_backend.layers.rotary.apply_rotary`.

One program rotates every head of one token, so a decoder layer rotates q and k together in one launch when
they sit side by side in the fused qkv projection's output (a [T, heads + kv_heads, head_dim] view of it).
The rotation runs in float32 from the float32 cos/sin of `rotary_angles`, as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_for_previous_kernel


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_cos, stride_sin, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    cos = tl.load(cos_ptr + token * stride_cos + dims)[None, :]  # [1, HALF] float32
    sin = tl.load(sin_ptr + token * stride_sin + dims)[None, :]
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]  # [BLOCK_H, HALF]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotate_in_place(
    x: torch.Tensor,  # [T, heads, head_dim], any token and head strides, contiguous head_dim
    cos: torch.Tensor,  # [T, head_dim // 2] float32
    sin: torch.Tensor,  # [T, head_dim // 2] float32
) -> torch.Tensor:
    """Rotate `x` in place (rotate-half layout) and return it."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotate_in_place: x, cos and sin need a contiguous last dimension")
    if half != triton.next_power_of_2(half) or cos.shape != (num_tokens, half) or sin.shape != (num_tokens, half):
        raise ValueError(f"rotate_in_place: head_dim {head_dim} must be twice a power of two, with cos and sin "
                         f"of shape ({num_tokens}, {half})")
    if num_tokens == 0:
        return x
    block_h = min(64, triton.next_power_of_2(num_heads))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, cos, sin,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), num_heads,
        HALF=half, BLOCK_H=block_h, USE_PDL=use_pdl(x), num_warps=4, launch_pdl=use_pdl(x),
    )
    return x
