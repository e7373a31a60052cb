"""Which predicted tokens a step keeps: batched over every predicted position of every request.

Positions are grouped into segments, one per LogitBlock. Under SamplingMode.THRESHOLD a masked position is
accepted when its confidence clears the request's accept threshold; the first block in flight accepts at least
its most confident position, so every step makes progress. Under SamplingMode.TOPK each segment accepts its
`num_transfer` most confident masked positions (LLaDA's low-confidence remasking). Filled positions of later
blocks whose token has fallen under the remask threshold go back to mask; the first block is never remasked,
which is what guarantees that decoding ends.

This module is the reference and the CPU path; on CUDA the runner asks for the one-launch kernel
(`diffulex_kernels.accept_tokens`), which computes the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingMode


@dataclass
class AcceptanceBatch:
    current: torch.Tensor  # [A] int64: tokens before this step (mask where undecided)
    predicted: torch.Tensor  # [A] int64: the sampler's choice
    confidence: torch.Tensor  # [A] float32: the sampler's confidence in it
    current_logit: torch.Tensor  # [A]: the model's logit of the current token, in the logits' dtype
    logsumexp: torch.Tensor  # [A] float32: of each row's logits, so exp(current_logit - logsumexp) is its probability
    seg_offsets: torch.Tensor  # [S + 1] int64: where each segment (block) starts; its positions are contiguous
    max_segment_len: int
    seg_first: torch.Tensor  # [S] bool: the request's first block in flight
    seg_enabled: torch.Tensor  # [S] bool: may accept this step
    seg_accept_threshold: torch.Tensor  # [S] float32
    seg_remask_threshold: torch.Tensor  # [S] float32
    seg_num_transfer: torch.Tensor  # [S] int64 (TOPK mode)


class AcceptanceRule:
    """Decides which predictions a step keeps. It samples nothing: the sampler has chosen every token already."""

    def __init__(self, mode: SamplingMode, mask_token_id: int):
        self.mode = mode
        self.mask_token_id = mask_token_id

    def __call__(self, batch: AcceptanceBatch, use_kernel: bool = False) -> torch.Tensor:
        """[A] int64: the tokens after this step; `use_kernel` takes the Triton kernel (CUDA tensors)."""
        if use_kernel:
            from diffulex_kernels import accept_tokens

            return accept_tokens(batch, self.mask_token_id, self.mode == SamplingMode.TOPK)
        masked = batch.current == self.mask_token_id
        num_segs = batch.seg_first.numel()
        # The segment of each position; output_size spares the device a sync on the total.
        seg = torch.repeat_interleave(torch.arange(num_segs, device=masked.device), batch.seg_offsets.diff(),
                                      output_size=masked.numel())
        eligible = masked & batch.seg_enabled[seg]
        if self.mode == SamplingMode.THRESHOLD:
            accept = eligible & (batch.confidence >= batch.seg_accept_threshold[seg])
            accepted = torch.zeros(num_segs, dtype=torch.int64, device=seg.device).index_add_(0, seg, accept.long())
            need_one = batch.seg_first & (accepted == 0)
            accept |= need_one[seg] & (_segment_rank(batch.confidence, eligible, seg, num_segs) == 0)
        else:
            rank = _segment_rank(batch.confidence, eligible, seg, num_segs)
            accept = eligible & (rank < batch.seg_num_transfer[seg])
        # Gather, then upcast: the same values as upcasting all logits first, without an [A, vocab] copy.
        current_prob = torch.exp(batch.current_logit.to(batch.logsumexp.dtype) - batch.logsumexp)
        remask = ~masked & ~batch.seg_first[seg] & (current_prob < batch.seg_remask_threshold[seg])
        out = torch.where(accept, batch.predicted, batch.current)
        return torch.where(remask, torch.full_like(out, self.mask_token_id), out)


def _segment_rank(score: torch.Tensor, eligible: torch.Tensor, seg: torch.Tensor, num_segs: int) -> torch.Tensor:
    """Rank of each eligible position by descending score within its segment (ties: lower index first);
    ineligible positions get a rank past every eligible one."""
    n = score.numel()
    masked_score = torch.where(eligible, score, torch.full_like(score, float("-inf")))
    by_score = torch.sort(masked_score, descending=True, stable=True).indices
    order = by_score[torch.sort(seg[by_score], stable=True).indices]  # grouped by segment, best first
    seg_sorted = seg[order]
    seg_start = torch.zeros(num_segs + 1, dtype=torch.int64, device=seg.device)
    # A count by index_add, not bincount: on CUDA bincount reads the maximum back to the host.
    counts = torch.zeros(num_segs, dtype=torch.int64, device=seg.device).index_add_(0, seg, torch.ones_like(seg))
    seg_start[1:] = counts.cumsum(0)
    rank = torch.empty(n, dtype=torch.int64, device=seg.device)
    rank[order] = torch.arange(n, device=seg.device) - seg_start[seg_sorted]
    return torch.where(eligible, rank, torch.full_like(rank, n))
