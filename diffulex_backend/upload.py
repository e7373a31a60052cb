"""Host tensors to the device without stalling the host: one pinned staging buffer and one non-blocking copy
per dtype. A copy from pageable memory would wait for the device to reach it, so host work queued behind a
running forward would no longer overlap it."""
from __future__ import annotations

import torch


def upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The same tensors on `device`, in order. On the CPU they are returned as they are."""
    if device.type != "cuda":
        return list(tensors)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for dtype, indices in by_dtype.items():
        sizes = [tensors[i].numel() for i in indices]
        staged = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        torch.cat([tensors[i].reshape(-1) for i in indices], out=staged)
        # The caching host allocator keeps `staged` from reuse until this copy has run.
        pieces = staged.to(device, non_blocking=True).split(sizes)
        for i, piece in zip(indices, pieces):
            out[i] = piece.view(tensors[i].shape)
    return out
