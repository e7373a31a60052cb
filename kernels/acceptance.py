"""The acceptance rule in one launch: the kernel twin of `diffulex_backend.acceptance.AcceptanceRule`.

The torch rule is some forty small launches (two sorts for the per-segment ranks among them); each costs a few
microseconds of device time after the LM head, on every step at every batch size. Here a program owns one tile
of a segment's positions and ranks them by counting, over the segment's other positions, the eligible ones that
beat each (higher confidence, or equal and earlier): the same order as the reference's stable descending sort.
Segments are at most one block long, so the count is cheap.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_I = 32  # positions a program decides
BLOCK_J = 32  # positions compared against per loop step


@triton.jit
def _accept_kernel(
    current_ptr, predicted_ptr, confidence_ptr, current_logit_ptr, logsumexp_ptr, seg_offsets_ptr,
    seg_first_ptr, seg_enabled_ptr, seg_accept_ptr, seg_remask_ptr, seg_num_transfer_ptr, out_ptr,
    mask_token_id,
    TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):
    seg = tl.program_id(0)
    lo = tl.load(seg_offsets_ptr + seg)
    hi = tl.load(seg_offsets_ptr + seg + 1)
    i = lo + tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # past a short segment's end: all masked off
    valid = i < hi
    first = tl.load(seg_first_ptr + seg) != 0
    enabled = tl.load(seg_enabled_ptr + seg) != 0
    accept_threshold = tl.load(seg_accept_ptr + seg)

    current = tl.load(current_ptr + i, mask=valid, other=0)
    masked = current == mask_token_id
    eligible = masked & enabled & valid
    score = tl.load(confidence_ptr + i, mask=valid, other=0.0)

    # rank: eligible positions of the segment that come before this one in descending confidence (ties: lower
    # index first). segment_accepts: eligible positions of the whole segment over the accept threshold.
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    segment_accepts = tl.zeros([BLOCK_J], dtype=tl.int32)
    for j0 in range(lo, hi, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        valid_j = j < hi
        eligible_j = (tl.load(current_ptr + j, mask=valid_j, other=0) == mask_token_id) & enabled & valid_j
        score_j = tl.load(confidence_ptr + j, mask=valid_j, other=0.0)
        beats = (score_j[None, :] > score[:, None]) | ((score_j[None, :] == score[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((beats & eligible_j[None, :]).to(tl.int32), axis=1)
        segment_accepts += (eligible_j & (score_j >= accept_threshold)).to(tl.int32)

    if TOPK:
        accept = eligible & (rank < tl.load(seg_num_transfer_ptr + seg))
    else:
        # The first block in flight takes at least its most confident position, so every step makes progress.
        need_one = first & (tl.sum(segment_accepts, axis=0) == 0)
        accept = eligible & ((score >= accept_threshold) | (need_one & (rank == 0)))

    current_logit = tl.load(current_logit_ptr + i, mask=valid, other=0.0).to(tl.float32)
    current_prob = tl.exp(current_logit - tl.load(logsumexp_ptr + i, mask=valid, other=0.0))
    # Later blocks only: remasking the first block could take back its only progress.
    remask = (first == 0) & ~masked & (current_prob < tl.load(seg_remask_ptr + seg))
    out = tl.where(accept, tl.load(predicted_ptr + i, mask=valid, other=0), current)
    out = tl.where(remask, mask_token_id, out)
    tl.store(out_ptr + i, out, mask=valid)


def accept_tokens(batch, mask_token_id: int, topk: bool) -> torch.Tensor:
    """[A] int64: the tokens after this step, as `AcceptanceRule` computes them from `batch` (an
    AcceptanceBatch). Segments are contiguous: `batch.seg_offsets` [S + 1] says where each starts, and
    `batch.max_segment_len` (host) sizes the grid."""
    out = torch.empty_like(batch.current)
    num_segs = batch.seg_first.numel()
    if num_segs == 0 or batch.max_segment_len == 0:
        return out
    grid = (num_segs, triton.cdiv(batch.max_segment_len, BLOCK_I))
    _accept_kernel[grid](
        batch.current, batch.predicted, batch.confidence, batch.current_logit, batch.logsumexp, batch.seg_offsets,
        batch.seg_first, batch.seg_enabled, batch.seg_accept_threshold, batch.seg_remask_threshold,
        batch.seg_num_transfer, out, mask_token_id,
        TOPK=topk, BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, num_warps=4,
    )
    return out
