"""Programmatic dependent launch (Hopper and later).

A kernel launched with it may be scheduled while the kernel before it drains, instead of after it has ended;
its first act is `wait_for_previous_kernel`, which returns once every earlier kernel has finished and its writes
are visible. Inside a CUDA graph this hides much of the gap between two nodes, which at batch 1 is paid about
ten times per layer. Every kernel of the decoder forward starts with the wait, so launching any of them this way
is safe whatever ran before it.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels on `tensor`'s device launch dependent (a CUDA device of compute capability 9 or later)."""
    return tensor.is_cuda and _device_supports_pdl(tensor.device.index or 0)


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
