"""One forward's model inputs on the host: token ids, positions and attention metadata for a varlen batch.

The runner builds it from the scheduler's plans, then either uploads it as it is (eager) or replays a CUDA graph
over it (cuda_graph.py). The seven inputs live in one flat buffer (`FlatLayout`), padded to the sizes of the
graph bucket the batch would replay in, so that either path moves them to the device with one copy and a replay
needs no host work on them at all. The arrays are written with numpy: a batch is a few small arrays, and a
torch op costs several times a numpy one on arrays this small.
"""
from __future__ import annotations

import array
import dataclasses
import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata, DenseAttention, dense_attention_of
from .plan import SeqPlan


def round_up_tokens(n: int) -> int:
    """Multiples of 32 up to 512, then 16 sizes per octave: padding stays under 1/16 of the forward."""
    step = max(32, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step


def round_up_seqs(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8 (empty sequences cost the attention grid almost nothing)."""
    return 1 << max(0, (n - 1).bit_length()) if n <= 8 else -(-n // 8) * 8


@dataclass(frozen=True)
class FlatLayout:
    """Where the inputs of a batch of up to (num_tokens, num_seqs) sequences and num_page_columns pages each lie
    in one flat int64 buffer: the three int64 inputs, then the four int32 ones in the same bytes, each starting
    16-byte aligned so that kernels may load them vectorised."""

    num_tokens: int
    num_seqs: int
    num_page_columns: int

    @functools.cached_property
    def spans(self) -> list[tuple[bool, int, int]]:  # per input: (int64?, start, end) in elements of its width
        sizes = [(8, self.num_tokens)] * 3 + [(4, self.num_tokens), (4, self.num_seqs + 1), (4, self.num_seqs),
                                              (4, self.num_seqs * self.num_page_columns)]
        spans, offset = [], 0  # bytes
        for width, count in sizes:
            spans.append((width == 8, offset // width, offset // width + count))
            offset = -(-(offset + width * count) // 16) * 16
        return spans

    @property
    def size(self) -> int:  # int64 elements
        return -(-self.spans[-1][2] // 2)

    def fields(self, ints64, ints32) -> list:
        """The seven inputs at full size, as views of one buffer given as int64 and as int32 (torch or numpy):
        input_ids, positions, slot_mapping, block_ids, cu_seqlens_q, context_lens, page_tables."""
        views = [(ints64 if is_int64 else ints32)[start:end] for is_int64, start, end in self.spans]
        views[-1] = views[-1].reshape(self.num_seqs, self.num_page_columns)
        return views


@functools.lru_cache(maxsize=4096)
def flat_layout(num_tokens: int, num_seqs: int, num_page_columns: int) -> FlatLayout:
    return FlatLayout(num_tokens, num_seqs, num_page_columns)


def host_buffer(size: int, pin_memory: bool) -> torch.Tensor:
    """A zeroed flat buffer. A pinned one uploads without waiting for the device, and the caching host allocator
    keeps it from reuse until the copies from it have run."""
    return torch.zeros(size, dtype=torch.int64, pin_memory=pin_memory)


def _input(index: int, doc: str) -> property:
    return property(lambda batch: batch.inputs[index], doc=doc)


@dataclass
class ForwardBatch:
    """`flat` (host or device) holds the inputs padded to `layout`: rows past the real ones are token 0 at
    position 0 in block 0 with slot -1, sequences past the real ones are empty (cu_seqlens_q repeats the total,
    context 0), page tables are -1 past each sequence's pages. The input properties are views of the real part."""

    flat: torch.Tensor  # [layout.size] int64
    layout: FlatLayout
    num_tokens: int
    num_seqs: int
    max_seqlen_q: int
    max_context_len: int
    # Soft inputs (dmax; SeqPlan.soft_ids), padded to layout.num_tokens rows with weight 0, or None.
    soft_ids: torch.Tensor | None = None  # [layout.num_tokens, K] int64
    soft_coef: torch.Tensor | None = None  # [layout.num_tokens, K + 1] float32
    dense: DenseAttention | None = None  # the attention as two dense ones, where it is (attention.py); host arrays

    @functools.cached_property
    def inputs(self) -> list[torch.Tensor]:
        """The seven inputs' real parts, in FlatLayout.fields order."""
        n, b = self.num_tokens, self.num_seqs
        views = self.layout.fields(self.flat, self.flat.view(torch.int32))
        return [view[:size] for view, size in zip(views, (n, n, n, n, b + 1, b, b))]

    input_ids = _input(0, "[T] int64")
    positions = _input(1, "[T] int64")
    slot_mapping = _input(2, "[T] int64: flat cache slot of each token's K/V, -1 = not stored")
    block_ids = _input(3, "[T] int32: the block mask (attention.py)")
    cu_seqlens_q = _input(4, "[B + 1] int32")
    context_lens = _input(5, "[B] int32")
    page_tables = _input(6, "[B, layout.num_page_columns] int32, -1 where unused")

    def padded_flat(self, layout: FlatLayout) -> torch.Tensor:
        """A host buffer holding the batch padded to `layout`: `flat` itself when the batch was built in it."""
        if layout == self.layout:
            return self.flat
        flat = host_buffer(layout.size, pin_memory=self.flat.is_pinned())
        ints64 = flat.numpy()
        input_ids, positions, slot_mapping, block_ids, cu_seqlens_q, context_lens, page_tables = layout.fields(
            ints64, ints64.view(np.int32))
        n, b, width = self.num_tokens, self.num_seqs, self.layout.num_page_columns
        for out, values in ((input_ids, self.input_ids), (positions, self.positions), (slot_mapping, self.slot_mapping),
                            (block_ids, self.block_ids), (cu_seqlens_q, self.cu_seqlens_q),
                            (context_lens, self.context_lens)):
            out[: values.shape[0]] = values.numpy()
        slot_mapping[n:] = -1
        cu_seqlens_q[b + 1:] = n
        page_tables.fill(-1)
        page_tables[:b, :width] = self.page_tables.numpy()
        return flat

    def padded_soft(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The soft inputs with `num_tokens` rows (>= the real ones): rows past the real ones have weight 0."""
        if self.soft_ids.shape[0] == num_tokens:
            return self.soft_ids, self.soft_coef
        ids = torch.zeros((num_tokens, self.soft_ids.shape[1]), dtype=torch.int64)
        coef = torch.zeros((num_tokens, self.soft_coef.shape[1]), dtype=torch.float32)
        n = self.num_tokens
        ids[:n], coef[:n] = self.soft_ids[:n], self.soft_coef[:n]
        return ids, coef

    def soft_to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The real rows of the soft inputs on `device`, copied without blocking the host; None when there are none."""
        if self.soft_ids is None:
            return None
        n = self.num_tokens
        return (self.soft_ids[:n].to(device, non_blocking=True), self.soft_coef[:n].to(device, non_blocking=True))

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) on `device`, copied without blocking the host."""
        batch = self
        if device.type == "cuda":
            batch = dataclasses.replace(self, flat=self.flat.to(device, non_blocking=True))
        meta = AttentionMetadata(
            cu_seqlens_q=batch.cu_seqlens_q, context_lens=batch.context_lens, page_tables=batch.page_tables,
            slot_mapping=batch.slot_mapping, block_ids=batch.block_ids,
            max_seqlen_q=self.max_seqlen_q, max_context_len=self.max_context_len,
            cu_seqlens_q_host=tuple(self.cu_seqlens_q.tolist()), context_lens_host=tuple(self.context_lens.tolist()),
            dense=None if self.dense is None else self.dense.to(device),
        )
        return batch.input_ids, batch.positions, meta


def ranges(starts: list[int], ends: list[int]) -> torch.Tensor:
    """cat(arange(s, e) for s, e in zip(starts, ends)) as int64, without a Python loop over positions."""
    counts = [e - s for s, e in zip(starts, ends)]
    first_out = [0, *itertools.accumulate(counts)]  # where each range starts in the output
    shift = np.array([s - first for s, first in zip(starts, first_out)], dtype=np.int64)
    return torch.from_numpy(np.repeat(shift, counts) + np.arange(first_out[-1]))


def build_forward_batch(plans: list[SeqPlan], page_size: int, max_model_len: int, pin_memory: bool,
                        find_dense: bool = False) -> ForwardBatch:
    """The batch's inputs, padded to the bucket a graph would replay it in. Page tables get as many columns as the
    CUDA graphs take (max_model_len's pages) or more; `pin_memory` for a batch bound for a GPU; `find_dense` for an
    attention that takes a dense forward apart (flash_attention.py)."""
    num_seqs = len(plans)
    counts = [p.end - p.start for p in plans]
    context_lens = [p.context_len for p in plans]
    cu_seqlens_q = [0, *itertools.accumulate(counts)]
    num_tokens = cu_seqlens_q[-1]
    tables = [p.page_table for p in plans]
    max_pages = max(map(len, tables))
    columns = max(1, max_pages, -(-max_model_len // page_size))
    layout = flat_layout(round_up_tokens(num_tokens), round_up_seqs(num_seqs), columns)
    flat = host_buffer(layout.size, pin_memory)  # zero pads all but three inputs
    ints64 = flat.numpy()
    input_ids, positions, slot_mapping, block_ids, cu_seqlens_out, context_lens_out, page_tables = layout.fields(
        ints64, ints64.view(np.int32))

    # The page tables with one more column of -1: a cache index of -1 maps to page -1 and offset page_size - 1,
    # so to slot -1 with no mask. array.array takes a list fastest.
    packed_tables, padding = array.array("i"), [-1] * (max_pages + 1)
    for table in tables:
        packed_tables.fromlist(table)
        packed_tables.fromlist(padding[len(table):])
    lookup = np.frombuffer(packed_tables, dtype=np.int32).reshape(num_seqs, max_pages + 1)
    page_tables.fill(-1)
    page_tables[:num_seqs, :max_pages] = lookup[:, :max_pages]
    # Page retention: the attention reads the kept pages only, packed, over a context shortened by the dropped
    # ones (all whole pages inside it); the lookup above keeps the holes, so cache slots stay where they were.
    for seq, plan in enumerate(plans):
        if plan.num_dropped_pages:
            kept = [page for page in plan.page_table if page >= 0]
            page_tables[seq] = -1
            page_tables[seq, :len(kept)] = kept
            context_lens[seq] -= plan.num_dropped_pages * page_size
    cu_seqlens_out[:] = cu_seqlens_q + [num_tokens] * (layout.num_seqs - num_seqs)
    context_lens_out[:num_seqs] = context_lens
    input_ids[:num_tokens] = np.concatenate([p.token_ids for p in plans])
    block_ids[:num_tokens] = np.concatenate([p.block_ids for p in plans])
    seq_of_token = np.arange(num_seqs).repeat(counts)
    first_position = np.array([p.start - first for p, first in zip(plans, cu_seqlens_q)], dtype=np.int64)
    np.add(first_position[seq_of_token], np.arange(num_tokens), out=positions[:num_tokens])
    # Logical cache index -> flat slot through each token's own page table row.
    page, offset = np.divmod(np.concatenate([p.cache_index for p in plans]), page_size)
    slots = slot_mapping[:num_tokens]
    np.multiply(lookup[seq_of_token, page], page_size, out=slots)
    slots += offset
    slot_mapping[num_tokens:] = -1
    soft_ids = soft_coef = None
    soft = [p for p in plans if p.soft_ids is not None]
    if soft:
        # Zero rows (weight 0: fed as their token) for the padding and for plans without soft inputs.
        k = soft[0].soft_ids.shape[1]
        soft_ids = torch.zeros((layout.num_tokens, k), dtype=torch.int64, pin_memory=pin_memory)
        soft_coef = torch.zeros((layout.num_tokens, k + 1), dtype=torch.float32, pin_memory=pin_memory)
        ids_out, coef_out = soft_ids.numpy(), soft_coef.numpy()
        for p, first in zip(plans, cu_seqlens_q):
            if p.soft_ids is not None:
                ids_out[first:first + p.num_tokens] = p.soft_ids
                coef_out[first:first + p.num_tokens] = p.soft_coef
    dense = dense_attention_of([p.block_ids for p in plans], max(context_lens)) if find_dense else None
    return ForwardBatch(flat=flat, layout=layout, num_tokens=num_tokens, num_seqs=num_seqs,
                        max_seqlen_q=max(counts), max_context_len=max(context_lens), soft_ids=soft_ids,
                        soft_coef=soft_coef, dense=dense)
