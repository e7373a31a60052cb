"""The LoRA delta of a fused projection, batched over a mixed batch: each request's rows take their own adapter,
and rows without one are skipped.

Every adapter of a projection lives in one slot of a stack. A fused projection (qkv, gate_up) has one A per
part; the parts sit side by side along the rank, and B is block-diagonal over them, so one shrink and one expand
per adapter cover all parts:

    A: [max_loras, parts * max_rank, in]      rows [i * max_rank, i * max_rank + r) are part i's A
    B: [max_loras, out, parts * max_rank]     rows of part i, columns of part i: part i's B times the scale

An adapter of lower rank, or one that leaves a part (say k) alone, is zero there. The delta of a segment of rows
that share an adapter is x · Aᵀ · Bᵀ (shrink, then expand): the punica/S-LoRA split, in torch here and in two
Triton launches on CUDA (`diffulex_kernels.lora`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class LoraStack:
    """The adapters of one projection, by slot. Not a parameter: checkpoints and `checkpoint_layout` never see it."""

    a: torch.Tensor  # [max_loras, parts * max_rank, in]
    b: torch.Tensor  # [max_loras, out, parts * max_rank], the scale folded in


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of a forward take which adapter: segments of consecutive rows, rows outside every segment take
    none. Built on the host from the plans; the same for every projection of the forward."""

    segments: tuple[tuple[int, int, int], ...]  # (slot, first row, end row), rows of the [T, ...] activations

    def __bool__(self) -> bool:
        return bool(self.segments)

    @functools.cached_property
    def max_rows(self) -> int:
        return max((end - start for _, start, end in self.segments), default=0)


@functools.lru_cache(maxsize=64)
def _device_segments(segments: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
    """[S, 3] int64 on `device`: one upload per segment layout, shared by every projection of every step."""
    return torch.tensor(segments, dtype=torch.int64).to(device)


def add_lora(out: torch.Tensor, x: torch.Tensor, stack: LoraStack | None, batch: LoraBatch | None) -> torch.Tensor:
    """out [T, out] + each segment's x [rows, in] · A[slot]ᵀ · B[slot]ᵀ, in place on the segment's rows."""
    if stack is None or not batch:
        return out
    if out.is_cuda:
        from diffulex_kernels.lora import add_lora_segments  # imports Triton: only on CUDA

        return add_lora_segments(out, x, stack.a, stack.b, _device_segments(batch.segments, out.device),
                                 batch.max_rows)
    for slot, start, end in batch.segments:
        shrunk = x[start:end] @ stack.a[slot].T  # [rows, parts * max_rank]
        out[start:end] += shrunk @ stack.b[slot].T  # [rows, out]
    return out
