"""Attention over a paged KV cache for diffusion blocks, and its metadata.

One forward holds a varlen batch of sequences. The query tokens of a sequence are whatever the step
feeds for it (a prompt chunk, a block being committed, the blocks in flight). Each query token attends to
  * the sequence's cached tokens `[0, context_len)`, read from its pages, all visible; and
  * the in-forward tokens of its own sequence, under the block mask: query i sees key j iff
    `block_ids[j] <= block_ids[i]`.
The block mask expresses every pattern the strategies need with one integer per token:
  * causal prompt:                 block_id = position
  * bidirectional prompt (d2f):    block_id = the same value for every prompt token
  * blocks in flight:              block_id = the block's first position (bidirectional inside a block,
                                   causal across blocks)
  * full attention (vanilla):      block_id = 0 everywhere
Tokens with `slot_mapping >= 0` also have their K/V written to the cache at that slot. The context never
includes the in-forward tokens of the same step, so the store may happen before or after the read.

This module is the reference (torch) implementation and the CPU path. Kernels implement the same functions
with the same metadata; `attention_backend` picks one.

A forward whose sequences all start with no cached context, each a prompt that sees itself fully or causally and
at most one block after it (a prompt's first forward, for every strategy but a block-causal prompt's), is two
dense varlen attentions: `AttentionMetadata.dense` says how, and a dense kernel (flash_attention.py) may take it.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class AttentionObserver(Protocol):
    """What a forward's attention reports its queries to, layer by layer (retention.RetentionStats)."""

    def add(self, query: torch.Tensor, k_cache: torch.Tensor, meta: "AttentionMetadata", scale: float) -> None: ...


class HeadMask(enum.Enum):
    """How a dense head's tokens see each other: all of them (block ids all equal), or those up to themselves (block
    ids increasing)."""

    FULL = "full"
    CAUSAL = "causal"


@dataclass(frozen=True)
class DenseAttention:
    """A forward with no cached context whose every sequence is a dense head (HeadMask), then at most one trailing
    group of equal block ids (a block after its prompt) that sees the whole sequence. Two dense varlen attentions
    compute it: the heads among themselves, and the tails over their whole sequences. Row indices and cumulative
    lengths are host arrays; `to(device)` uploads them once per forward."""

    head_mask: HeadMask
    head_rows: np.ndarray | torch.Tensor | None  # [H] rows of the heads; None when there are no tails (every row)
    cu_head: np.ndarray | torch.Tensor  # [B + 1] int32
    max_head: int
    tail_rows: np.ndarray | torch.Tensor | None  # [T - H]; None when no sequence has a tail
    cu_tail: np.ndarray | torch.Tensor | None  # [B + 1] int32, zero-length for a sequence without a tail
    max_tail: int

    def to(self, device: torch.device) -> "DenseAttention":
        def up(array):
            return None if array is None else torch.from_numpy(array).to(device, non_blocking=True)

        return dataclasses.replace(self, head_rows=up(self.head_rows), cu_head=up(self.cu_head),
                                   tail_rows=up(self.tail_rows), cu_tail=up(self.cu_tail))


# A sequence's head, as dense_attention_of classifies it: not dense, one token (either mask), full or causal.
_NOT_DENSE, _EITHER, _FULL, _CAUSAL = -1, 0, 1, 2


def dense_attention_of(block_ids: list[np.ndarray], max_context_len: int) -> DenseAttention | None:
    """The forward's DenseAttention from each sequence's block ids, or None when its mask is anything else (a
    cached context, blocks in flight, a block-causal prompt). Whole-batch array operations, no loop over sequences:
    it runs on the host for every forward without a cached context."""
    if max_context_len > 0:
        return None
    lengths = np.array([len(ids) for ids in block_ids], dtype=np.int64)
    ids = np.concatenate(block_ids).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    seq = np.repeat(np.arange(len(lengths)), lengths)
    inside = seq[1:] == seq[:-1]  # the steps between two tokens of one sequence
    steps, step_seq = np.diff(ids)[inside], seq[:-1][inside]
    if (steps < 0).any():
        return None

    def per_sequence(where: np.ndarray) -> np.ndarray:
        return np.bincount(step_seq, weights=where, minlength=len(lengths)).astype(np.int64)

    # Block ids never go down, so a sequence's head is its tokens below its last id, and its tail the rest.
    below = ids < ids[starts + lengths - 1][seq]
    head_lens = np.bincount(seq, weights=below, minlength=len(lengths)).astype(np.int64)
    rising, in_head = steps > 0, below[1:][inside]  # a step ends in the head only if it starts there
    head_flat, head_rising = per_sequence(~rising & in_head), per_sequence(rising & in_head)
    all_equal, all_rising = head_lens == 0, per_sequence(rising) == lengths - 1
    masks = np.full(len(lengths), _NOT_DENSE)
    masks[head_flat == head_lens - 1] = _FULL
    masks[head_rising == head_lens - 1] = _CAUSAL
    masks[head_lens == 1] = _EITHER
    masks[all_equal] = np.where(lengths[all_equal] > 1, _FULL, _EITHER)
    masks[all_rising & ~all_equal] = _CAUSAL
    head_lens[all_equal | all_rising] = lengths[all_equal | all_rising]  # no tail
    kinds = set(masks.tolist()) - {_EITHER}
    if _NOT_DENSE in kinds or len(kinds) > 1:  # one dense launch takes one mask
        return None
    head_mask = HeadMask.CAUSAL if kinds == {_CAUSAL} else HeadMask.FULL
    cu_head = np.concatenate([[0], np.cumsum(head_lens)]).astype(np.int32)
    if (head_lens == lengths).all():
        return DenseAttention(head_mask, None, cu_head, int(head_lens.max()), None, None, 0)
    in_head_rows = np.arange(len(ids)) - starts[seq] < head_lens[seq]
    tail_lens = lengths - head_lens
    return DenseAttention(head_mask, np.flatnonzero(in_head_rows), cu_head, int(head_lens.max()),
                          np.flatnonzero(~in_head_rows), np.concatenate([[0], np.cumsum(tail_lens)]).astype(np.int32),
                          int(tail_lens.max()))


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    context_lens: torch.Tensor  # [B] int32: cached tokens each sequence attends to
    page_tables: torch.Tensor  # [B, max_pages] int32, -1 where unused
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token's K/V, -1 to skip the store
    block_ids: torch.Tensor  # [T] int32: the block mask, see the module docstring
    max_seqlen_q: int
    max_context_len: int
    # Host copies of the two small per-sequence vectors, so the reference path never syncs a device.
    cu_seqlens_q_host: tuple[int, ...] = ()
    context_lens_host: tuple[int, ...] = ()
    # Set on the one eager forward that measures attention for page retention (retention.py); None otherwise.
    retention_stats: AttentionObserver | None = None
    # Set by the host on an eager forward whose mask is dense (DenseAttention); None otherwise, and always in a
    # CUDA graph, whose kernels must serve every batch that replays it.
    dense: DenseAttention | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)


def store_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim], or FP8 rows (uint8, head_dim + 4)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for rows, cache in ((key[keep], k_cache), (value[keep], v_cache)):
        if cache.dtype == torch.uint8:  # FP8 rows: each (token, head) row with its own scale
            from diffulex_kernels.kv_store import fp8_rows, quantize_rows

            values, scales = fp8_rows(cache)
            values.view(-1, *values.shape[2:])[slots], scales.view(-1, scales.shape[2])[slots] = quantize_rows(rows)
        else:
            cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)


def cache_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [*slots.shape, kv_heads, head_dim]
    """The cached K (or V) rows at flat slots; from FP8 rows, their values times their scales, in float32."""
    if cache.dtype != torch.uint8:
        return cache.view(-1, *cache.shape[2:])[slots]
    from diffulex_kernels.kv_store import fp8_rows

    values, scales = fp8_rows(cache)
    return values.view(-1, *values.shape[2:])[slots].float() * scales.view(-1, scales.shape[2])[slots][..., None]


def gather_context(
    cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim], or FP8 rows
    page_table: torch.Tensor,  # [max_pages]
    context_len: int,
) -> torch.Tensor:  # [context_len, kv_heads, head_dim]
    page_size = cache.shape[1]
    pos = torch.arange(context_len, device=cache.device)
    slots = page_table[pos // page_size].long() * page_size + pos % page_size
    return cache_rows(cache, slots)


def paged_attention_reference(
    query: torch.Tensor,  # [T, heads, head_dim]
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor | None,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    *,
    kv_stored: bool = False,  # the caller already stored the in-forward K/V
    # Each row's attention over its cached context, computed elsewhere: (out [T, heads, head_dim], lse [heads, T],
    # natural log, -inf or NaN where a row saw no key), as flash-attn returns them; then there is no cache.
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [T, heads, head_dim]
    """Store, then attend. One loop over sequences; everything inside is batched over tokens and heads."""
    if prior is not None and k_cache is not None:
        raise ValueError("paged_attention_reference: a prior stands for the cached context: it takes no cache")
    if k_cache is not None and not kv_stored:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(query)
    cu = meta.cu_seqlens_q_host
    for b in range(meta.num_seqs):
        rows = slice(cu[b], cu[b + 1])
        q, k, v = query[rows], key[rows], value[rows]
        n = q.shape[0]
        if n == 0:
            continue
        ctx = meta.context_lens_host[b]
        blk = meta.block_ids[rows]
        visible = blk[None, :] <= blk[:, None]  # [n, n]
        if ctx and prior is None:
            k = torch.cat([gather_context(k_cache, meta.page_tables[b], ctx).to(k.dtype), k])
            v = torch.cat([gather_context(v_cache, meta.page_tables[b], ctx).to(v.dtype), v])
            visible = torch.cat([visible.new_ones(n, ctx), visible], dim=1)
        # [heads, n, d] x [heads, ctx + n, d], in at least float32 so that bf16 inputs keep a float32 reference.
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = q.transpose(0, 1).to(acc)
        ka = k.transpose(0, 1).to(acc).repeat_interleave(group, dim=0)
        va = v.transpose(0, 1).to(acc).repeat_interleave(group, dim=0)
        if prior is None:
            o = F.scaled_dot_product_attention(qa, ka, va, attn_mask=visible, scale=scale)
        else:
            # The context is one more key per row, whose score is the row's lse and whose value its output; a row
            # whose lse is -inf or NaN saw no cached key.
            lse, context_out = prior[1][:, rows, None].to(acc), prior[0][rows].transpose(0, 1).to(acc)
            seen = lse > -1.0e30
            lse, context_out = lse.where(seen, float("-inf")), context_out.where(seen, 0.0)
            scores = (qa @ ka.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
            weights = torch.softmax(torch.cat([lse, scores], dim=-1), dim=-1)
            o = weights[..., :1] * context_out + weights[..., 1:] @ va
        out[rows] = o.transpose(0, 1).to(out.dtype)
    return out


def context_attention_reference(
    query: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    page_tables: torch.Tensor,  # [B, max_pages]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, heads, head_dim], lse [heads, T] float32
    """Each query row's attention over its sequence's cached context alone, all visible, as flash-attn's paged
    varlen kernel computes it (`seqused_k` the context lengths, `return_lse`): the normalised output, and the
    natural log of the sum of the exponentiated scores, -inf (output 0) for a row whose sequence has no context."""
    heads, kv_heads = query.shape[1], k_cache.shape[2]
    out = torch.zeros_like(query)
    lse = torch.full((heads, query.shape[0]), float("-inf"), dtype=torch.float32, device=query.device)
    cu, lengths = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, ctx in enumerate(lengths):
        rows = slice(cu[b], cu[b + 1])
        if ctx == 0 or cu[b + 1] == cu[b]:
            continue
        acc = torch.promote_types(query.dtype, torch.float32)
        q = query[rows].transpose(0, 1).to(acc)
        k, v = (gather_context(cache, page_tables[b], ctx).to(acc).transpose(0, 1).repeat_interleave(
            heads // kv_heads, dim=0) for cache in (k_cache, v_cache))
        scores = q @ k.transpose(1, 2) * scale
        lse[:, rows] = torch.logsumexp(scores, dim=-1).float()
        out[rows] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(out.dtype)
    return out, lse
