"""Sparse attention by page retention: a request keeps `retention_ratio` of its prompt's KV pages and frees the rest.

Once a request's prompt is wholly in the cache (its last token included) and its first block is fed, the runner
measures how much attention the block's queries give each page of the context, per layer and head
(`RetentionStats`: one extra eager forward of the requests choosing in that step, once each, measured for all of
them at once in every layer). `select_pages` keeps:
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

from .attention import AttentionMetadata, cache_rows


@dataclass(frozen=True)
class Retention:
    """What a plan asks of the runner: measure the context and choose the pages to keep."""

    ratio: float  # in (0, 1)
    head_select: bool
    num_pages: int  # the prompt's pages: the only candidates (generated tokens' pages are always kept)


@dataclass
class RetentionStats:
    """Per-layer attention mass of each sequence's queries over its context pages, gathered by the attention of a
    forward that carries it in its metadata (each layer adds one entry)."""

    page_size: int
    layers: list[torch.Tensor] = field(default_factory=list)  # per layer: [seqs, heads, pages] float32

    def add(self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        """query [T, heads, head_dim] after RoPE; k_cache [num_pages, page_size, kv_heads, head_dim]. All the
        forward's sequences at once, padded to the longest query and context: a few launches a layer."""
        device, ps = query.device, self.page_size
        cu, contexts = meta.cu_seqlens_q_host, meta.context_lens_host
        seqs, heads = len(contexts), query.shape[1]
        lengths = torch.tensor([cu[b + 1] - cu[b] for b in range(seqs)], device=device)
        rows = torch.tensor(cu[:-1], device=device)[:, None] + torch.arange(int(lengths.max()), device=device)
        row_valid = rows < torch.tensor(cu[1:], device=device)[:, None]  # [B, n]
        q = query[torch.where(row_valid, rows, 0)].float()  # [B, n, heads, d]
        context = torch.tensor(contexts, device=device)
        pages = -(-max(contexts) // ps)
        pos = torch.arange(pages * ps, device=device)
        key_valid = pos[None, :] < context[:, None]  # [B, C]
        table = meta.page_tables[:, :pages].long().clamp_min(0)  # padding columns read page 0, masked below
        slots = table[:, pos // ps] * ps + pos % ps  # [B, C]
        k = cache_rows(k_cache, slots).float()  # [B, C, kv_heads, d]
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
        logits = torch.einsum("bnhd,bchd->bhnc", q, k).mul_(scale)
        logits.masked_fill_(~key_valid[:, None, None, :], float("-inf"))
        probs = logits.softmax(-1).nan_to_num_(0.0)  # an empty context row is all -inf: no mass
        probs.mul_(row_valid[:, None, :, None])
        mass = probs.sum(2) / lengths[:, None, None]  # [B, heads, C]: the mean over each sequence's queries
        self.layers.append(mass.view(seqs, heads, pages, ps).sum(-1))

    def scores(self, seq: int, num_pages: int) -> torch.Tensor:  # [num_pages, layers * heads] on the host
        return torch.cat([layer[seq, :, :num_pages] for layer in self.layers]).T.cpu()


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
