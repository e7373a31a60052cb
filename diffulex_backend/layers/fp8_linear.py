"""FP8 weights (float8_e4m3fn) with float32 scales: the weight math every quantized projection shares.

A quantized weight W [..., N, K] is held as q [..., N, K] in float8_e4m3fn and scale [..., N, G] in float32, and
stands for q * scale, each scale covering K / G consecutive columns of its row:
- G = 1 is a scale per output channel, what `quantization: fp8` writes at load;
- G > 1 holds a released checkpoint's 128×128 block scales, each repeated over the rows of its block, so that a
  share of rows (fused q/k/v parts, tensor parallelism) is a share of scale rows.

`Fp8Linear` is the projection that holds such a weight. On CUDA it runs the W8A8 kernels of
`diffulex_kernels.fp8` (activations cast to fp8 with a scale per token); elsewhere it dequantizes in float32 and
runs the float product, the reference the kernels are held to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row gets it, and quantizes to zeros instead of dividing by 0.
MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_weight(weight: torch.Tensor, groups: int = 1, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (q [..., N, K] float8_e4m3fn, scale [..., N, groups] float32): each group of K / groups
    columns of a row is scaled so that its largest magnitude (or `amax` [..., N, groups], when the row's other
    columns live elsewhere) lands on FP8_MAX, then rounded to nearest."""
    k = weight.shape[-1]
    if k % groups:
        raise ValueError(f"quantize_weight: {k} columns do not split into {groups} groups")
    w = weight.float().unflatten(-1, (groups, k // groups))  # [..., N, G, K / G]
    scale = ((w.abs().amax(-1) if amax is None else amax.float()) / FP8_MAX).clamp_min(MIN_SCALE)  # [..., N, G]
    q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., N, K] float8_e4m3fn, scale [..., N, G] -> q * scale [..., N, K] in float32."""
    groups, k = scale.shape[-1], q.shape[-1]
    return (q.float().unflatten(-1, (groups, k // groups)) * scale.float()[..., None]).flatten(-2)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., K] @ (weight * scale).T + bias -> [..., N] in x's dtype."""
    if x.is_cuda:
        from diffulex_kernels.fp8 import fp8_linear as kernel  # imports Triton: only on CUDA

        return kernel(x.reshape(-1, x.shape[-1]), weight, scale, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, dequantize_weight(weight, scale).to(x.dtype), bias)


class Fp8Linear(nn.Module):
    """A projection whose weight is float8_e4m3fn [N, K] with `weight_scale` [N, G]; the bias stays in the model's
    dtype. Parameters keep the names of the nn.Linear it replaces, plus `weight_scale`."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != FP8 or weight_scale.dtype != torch.float32 or weight_scale.shape[0] != weight.shape[0]:
            raise ValueError(f"Fp8Linear: weight {tuple(weight.shape)} {weight.dtype} and scale "
                             f"{tuple(weight_scale.shape)} {weight_scale.dtype} are not an fp8 weight and its scales")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)
