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

A forward's segments come as a `LoraBatch` (host tuples, built from the plans) or as `LoraSegments` (the same on
the device, in a table of fixed length: what a CUDA graph captures, refilled before each replay).
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


@dataclass(frozen=True)
class LoraSegments:
    """A forward's segments as the kernels read them: a device table, of which rows past the real segments are
    empty ones (0, 0, 0), and a bound on any segment's rows. Its shape and bound fix the kernels' grids, so a CUDA
    graph captured over one table serves every step whose segments fit it."""

    table: torch.Tensor  # [S, 3] int64 on the device: (slot, first row, end row)
    max_rows: int  # at least the rows of the longest segment


def segment_table(batch: LoraBatch, capacity: int, pin_memory: bool = False) -> torch.Tensor:
    """[capacity, 3] int64 on the host: the batch's segments in order, then empty segments (0, 0, 0)."""
    if len(batch.segments) > capacity:
        raise ValueError(f"{len(batch.segments)} LoRA segments do not fit a table of {capacity}")
    table = torch.zeros(capacity, 3, dtype=torch.int64, pin_memory=pin_memory)
    if batch.segments:
        table[:len(batch.segments)] = torch.tensor(batch.segments, dtype=torch.int64)
    return table


@functools.lru_cache(maxsize=64)
def device_segments(batch: LoraBatch, device: torch.device) -> LoraSegments:
    """The batch's segments on `device`, exactly as many as it has: one upload per segment layout, shared by every
    projection of every step with that layout (an eager forward's)."""
    return LoraSegments(torch.tensor(batch.segments, dtype=torch.int64).to(device), batch.max_rows)


def row_slots(table: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int32: each row's adapter slot from a segment table, -1 for a row of no segment. A few tensor ops
    on the device, so a CUDA graph captures them over its static table: slot + 1 is added at each segment's first
    row and taken off at its end, and the running sum is then the slot + 1 of every row (segments never overlap;
    an empty one cancels itself)."""
    marks = torch.zeros(num_rows + 1, dtype=torch.int64, device=table.device)
    plus_one = table[:, 0] + 1
    marks.index_add_(0, table[:, 1], plus_one)
    marks.index_add_(0, table[:, 2], -plus_one)
    return (marks.cumsum(0)[:num_rows] - 1).to(torch.int32)


def add_lora(out: torch.Tensor, x: torch.Tensor, stack: LoraStack | None,
             lora: LoraBatch | LoraSegments | None) -> torch.Tensor:
    """out [T, out] + each segment's x [rows, in] · A[slot]ᵀ · B[slot]ᵀ, in place on the segment's rows."""
    if stack is None or not lora:
        return out
    # The kernels take 16- and 32-bit floats; float64 (the exactness runs) takes the torch loop on any device.
    if out.is_cuda and x.element_size() <= 4:
        from diffulex_kernels.lora import add_lora_segments  # imports Triton: only on CUDA

        segments = lora if isinstance(lora, LoraSegments) else device_segments(lora, out.device)
        return add_lora_segments(out, x, stack.a, stack.b, segments.table, segments.max_rows)
    for slot, start, end in (lora.table.tolist() if isinstance(lora, LoraSegments) else lora.segments):
        if end > start:
            shrunk = x[start:end] @ stack.a[slot].T  # [rows, parts * max_rank]
            out[start:end] += shrunk @ stack.b[slot].T  # [rows, out]
    return out
