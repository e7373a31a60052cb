"""One forward's model inputs on the host: token ids, positions and attention metadata for a varlen batch.

The runner builds it from the scheduler's plans, then either uploads it as it is (eager) or pads it into a
CUDA graph bucket's static buffers (cuda_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .request import SeqPlan
from .upload import upload


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token's K/V, -1 = not stored
    block_ids: torch.Tensor  # [T] int32: the block mask (attention.py)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    page_tables: torch.Tensor  # [B, max_pages] int32, -1 where unused
    max_seqlen_q: int
    max_context_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel()

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) on `device`, copied without blocking the host."""
        input_ids, positions, slot_mapping, block_ids, cu_seqlens_q, context_lens, page_tables = upload(
            [self.input_ids, self.positions, self.slot_mapping, self.block_ids, self.cu_seqlens_q,
             self.context_lens, self.page_tables], device)
        meta = AttentionMetadata(
            cu_seqlens_q=cu_seqlens_q, context_lens=context_lens, page_tables=page_tables,
            slot_mapping=slot_mapping, block_ids=block_ids,
            max_seqlen_q=self.max_seqlen_q, max_context_len=self.max_context_len,
            cu_seqlens_q_host=tuple(self.cu_seqlens_q.tolist()), context_lens_host=tuple(self.context_lens.tolist()),
        )
        return input_ids, positions, meta


def ranges(starts: list[int], ends: list[int]) -> torch.Tensor:
    """cat(arange(s, e) for s, e in zip(starts, ends)), without a Python loop over positions."""
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int64)
    if int(lengths.sum()) == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - (lengths.cumsum(0) - lengths), lengths)
    return torch.arange(int(lengths.sum())) + offsets


def build_forward_batch(plans: list[SeqPlan], page_size: int) -> ForwardBatch:
    counts = [p.num_tokens for p in plans]
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    context_lens = [p.context_len for p in plans]
    max_pages = max(1, max(len(p.req.page_table) for p in plans))
    page_tables = torch.full((len(plans), max_pages), -1, dtype=torch.int32)
    for i, p in enumerate(plans):
        if p.req.page_table:
            page_tables[i, : len(p.req.page_table)] = torch.tensor(p.req.page_table, dtype=torch.int32)
    # Logical cache index -> flat slot through each token's own page table row.
    cache_index = torch.cat([p.cache_index for p in plans])
    seq_of_token = torch.repeat_interleave(torch.arange(len(plans)), torch.tensor(counts, dtype=torch.int64))
    clamped = cache_index.clamp(min=0)
    page = page_tables[seq_of_token, clamped // page_size].long() if cache_index.numel() else clamped
    return ForwardBatch(
        input_ids=torch.cat([p.req.tokens[p.start:p.end] for p in plans]),
        positions=ranges([p.start for p in plans], [p.end for p in plans]),
        slot_mapping=torch.where(cache_index >= 0, page * page_size + clamped % page_size, -1),
        block_ids=torch.cat([p.block_ids for p in plans]),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        page_tables=page_tables,
        max_seqlen_q=max(counts),
        max_context_len=max(context_lens),
    )
