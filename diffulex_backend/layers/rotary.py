"""Rotary position embedding in the rotate-half layout (LLaDA, LLaDA2, Qwen2, Qwen3).

The angles come from the token positions of this forward, so any position works without a precomputed
table, and the same code runs inside a CUDA graph (no host sync). Partial rotary (LLaDA2: `partial_rotary_factor`
0.5) rotates the first `rotary_dim` dims of each head with rotate-half over those dims, with frequencies of a
`rotary_dim`-wide rotary embedding, and passes the rest through unchanged.
"""
from __future__ import annotations

import torch


def rotary_angles(positions: torch.Tensor, rotary_dim: int, theta: float,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [T, rotary_dim // 2] in `dtype` (float32, or float64 for a float64 model), for positions
    [T]. rotary_dim is head_dim unless partial."""
    exponents = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=dtype) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]. Computed in float32 ("rope_full_precision"; float64 for a float64 model), returned
    in x's dtype. Rotates the first 2 * cos.shape[-1] dims; any further dims pass through."""
    rotary_dim = 2 * cos.shape[-1]
    x32 = x.to(torch.promote_types(x.dtype, cos.dtype))
    x1, x2 = x32[..., :rotary_dim].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) is x * cos + rotate_half(x) * sin on the halves.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary_dim:]), dim=-1).to(x.dtype)
