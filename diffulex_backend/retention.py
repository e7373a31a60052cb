"""Sparse attention by page retention: a request keeps `retention_ratio` of its prompt's KV pages and frees the rest.

Once a request's prompt is wholly in the cache and its first block is fed, the runner measures how much attention
the block's queries give each page of the context, per layer and head (`RetentionStats`, one extra eager forward
of that request, once). `select_pages` keeps:
  * the first page (the attention sink) and the last one (the text the block continues), always;
  * of the others, the pages the heads attend to most, up to ceil(retention_ratio x pages) in all:
      - `head_select` on: each head (of every layer) names its own top pages; pages are ranked by how many heads
        named them, then by mean attention. A page that a few heads need strongly (retrieval heads) outranks one
        that every head glances at;
      - off: pages ranked by mean attention over all heads.
The dropped pages leave the request's page table as holes (-1): their references return to the pool (a page
that no other request or the prefix cache holds is free again at once), the attention's page table skips them
(forward_batch.py packs the kept pages and shortens the context by what was dropped), so the attention kernels
never read them, and the request's later K/V pages are written where they would have been. Generated tokens'
pages are always kept. With ratio 1 nothing is measured or dropped: the output is dense attention's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .attention import AttentionMetadata, gather_context


@dataclass(frozen=True)
class Retention:
    """What a plan asks of the runner: measure the context and choose the pages to keep."""

    ratio: float  # in (0, 1)
    head_select: bool


@dataclass
class RetentionStats:
    """Per-layer attention mass of each sequence's queries over its context pages, gathered by SelfAttention
    during a forward that carries it in its metadata (a layer appends one entry per call)."""

    page_size: int
    layers: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][seq] -> [heads, pages] float32

    def add(self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        """query [T, heads, head_dim] after RoPE; k_cache [num_pages, page_size, kv_heads, head_dim]."""
        per_seq = []
        cu = meta.cu_seqlens_q_host
        for b, context in enumerate(meta.context_lens_host):
            q = query[cu[b]:cu[b + 1]].float()  # [n, heads, d]
            k = gather_context(k_cache, meta.page_tables[b], context).float()  # [ctx, kv_heads, d]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            probs = torch.einsum("nhd,chd->hnc", q, k).mul_(scale).softmax(-1).mean(1)  # [heads, ctx]
            pages = -(-context // self.page_size)
            padded = probs.new_zeros(probs.shape[0], pages * self.page_size)
            padded[:, :context] = probs
            per_seq.append(padded.view(probs.shape[0], pages, self.page_size).sum(-1))
        self.layers.append(per_seq)

    def scores(self, seq: int) -> torch.Tensor:  # [pages, layers * heads] on the host
        return torch.cat([layer[seq] for layer in self.layers]).T.cpu()


def select_pages(scores: np.ndarray, ratio: float, head_select: bool) -> np.ndarray:
    """The indices of the context pages to keep, ascending. scores: [pages, heads] attention mass (heads of every
    layer, in any order)."""
    pages = scores.shape[0]
    budget = max(2, math.ceil(ratio * pages))
    if budget >= pages:
        return np.arange(pages)
    middle = scores[1:-1]  # the sink and the last page are kept without a contest
    wanted = budget - 2
    mean = middle.mean(1)
    if head_select:
        # Each head's own top `wanted` pages (ties to the lower page), counted over heads.
        top = np.argsort(-middle, axis=0, kind="stable")[:wanted]  # [wanted, heads]
        votes = np.bincount(top.ravel(), minlength=middle.shape[0])
        order = np.lexsort((np.arange(len(mean)), -mean, -votes))  # by votes, then mean, then page
    else:
        order = np.lexsort((np.arange(len(mean)), -mean))
    kept = np.sort(order[:wanted]) + 1
    return np.concatenate([[0], kept, [pages - 1]])
