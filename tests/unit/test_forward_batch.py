"""build_forward_batch against a plain per-token reference, and the flat buffer it writes the inputs into."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffulex_backend.cuda_graph import GraphBucket
from diffulex_backend.forward_batch import (ForwardBatch, build_forward_batch, flat_layout, ranges, round_up_seqs,
                                           round_up_tokens)
from diffulex_backend.plan import RequestSampling, SeqPlan
from diffulex_backend.sampling import Confidence

PAGE_SIZE = 4
MAX_MODEL_LEN = 40  # 10 page columns
GREEDY = RequestSampling(seed=0, temperature=0.0, top_k=0, top_p=1.0, confidence_kind=Confidence.PROB,
                         accept_threshold=0.9, remask_threshold=0.0)


def pad_batch(batch: ForwardBatch, bucket: GraphBucket, num_page_columns: int, max_context_len: int) -> ForwardBatch:
    """The batch padded to the bucket's sizes on the host, as a replay sees it (cuda_graph.py's docstring)."""
    layout = flat_layout(bucket.num_tokens, bucket.num_seqs, num_page_columns)
    return ForwardBatch(batch.padded_flat(layout), layout, bucket.num_tokens, bucket.num_seqs, bucket.max_seqlen_q,
                        max_context_len)


def make_plan(start: int, end: int, context_len: int, cache_index: list[int], page_table: list[int],
              seed: int) -> SeqPlan:
    tokens = np.random.default_rng(seed).integers(0, 1000, end - start, dtype=np.int64)
    block_ids = np.arange(start, end, dtype=np.int32) // 8 * 8
    return SeqPlan(request_id=str(seed), start=start, end=end, context_len=context_len, token_ids=tokens,
                   cache_index=np.array(cache_index, dtype=np.int64), block_ids=block_ids, blocks=[],
                   page_table=page_table, committed_end=start, step=0, sampling=GREEDY)


def build(plans: list[SeqPlan]) -> ForwardBatch:
    return build_forward_batch(plans, PAGE_SIZE, MAX_MODEL_LEN, pin_memory=False)


def reference(plans: list[SeqPlan]) -> dict[str, list]:
    """The inputs computed one token at a time."""
    out = {name: [] for name in ("input_ids", "positions", "slot_mapping", "block_ids")}
    for p in plans:
        for i, position in enumerate(range(p.start, p.end)):
            index = int(p.cache_index[i])
            out["input_ids"].append(int(p.token_ids[i]))
            out["positions"].append(position)
            out["slot_mapping"].append(
                -1 if index < 0 else p.page_table[index // PAGE_SIZE] * PAGE_SIZE + index % PAGE_SIZE)
            out["block_ids"].append(int(p.block_ids[i]))
    out["cu_seqlens_q"] = [0]
    for p in plans:
        out["cu_seqlens_q"].append(out["cu_seqlens_q"][-1] + p.num_tokens)
    out["context_lens"] = [p.context_len for p in plans]
    out["page_tables"] = [p.page_table + [-1] * (MAX_MODEL_LEN // PAGE_SIZE - len(p.page_table))
                          for p in plans]
    return out


PLAN_SETS = {
    "one decode step": [make_plan(9, 17, 9, [9, 10, 11, 12, 13, 14, 15, -1], [7, 3, 5, 2, 8], seed=0)],
    "mixed": [
        make_plan(0, 6, 0, [0, 1, 2, 3, 4, 5], [4, 1], seed=1),  # a prefill chunk
        make_plan(12, 20, 12, [-1] * 8, [0, 6, 9], seed=2),  # nothing stored
        make_plan(3, 4, 3, [3], [11], seed=3),
    ],
    "no pages yet": [make_plan(0, 5, 0, [-1] * 5, [], seed=4), make_plan(0, 2, 0, [-1, -1], [], seed=5)],
}


@pytest.mark.parametrize("name", PLAN_SETS)
def test_build_forward_batch_matches_the_per_token_reference(name):
    plans = PLAN_SETS[name]
    batch = build(plans)
    expected = reference(plans)
    for field, values in expected.items():
        assert getattr(batch, field).tolist() == values, field
    assert batch.input_ids.dtype == batch.positions.dtype == batch.slot_mapping.dtype == torch.int64
    assert batch.block_ids.dtype == batch.cu_seqlens_q.dtype == batch.page_tables.dtype == torch.int32
    assert (batch.max_seqlen_q, batch.max_context_len) == (max(p.num_tokens for p in plans),
                                                           max(p.context_len for p in plans))


@pytest.mark.parametrize("name", PLAN_SETS)
def test_the_batch_is_built_padded_to_its_bucket(name):
    """Its flat buffer is what a graph replay uploads as it is: the padding of the module docstring."""
    plans = PLAN_SETS[name]
    batch = build(plans)
    n, b = batch.num_tokens, batch.num_seqs
    tokens, seqs = round_up_tokens(n), round_up_seqs(b)
    assert batch.layout == flat_layout(tokens, seqs, MAX_MODEL_LEN // PAGE_SIZE)
    bucket = GraphBucket(tokens, seqs, max_seqlen_q=32)
    padded = pad_batch(batch, bucket, MAX_MODEL_LEN // PAGE_SIZE, MAX_MODEL_LEN)
    assert padded.flat is batch.flat
    assert padded.input_ids[n:].eq(0).all() and padded.positions[n:].eq(0).all()
    assert padded.slot_mapping[n:].eq(-1).all() and padded.block_ids[n:].eq(0).all()
    assert padded.cu_seqlens_q.tolist() == batch.cu_seqlens_q.tolist() + [n] * (seqs - b)
    assert padded.context_lens.tolist() == batch.context_lens.tolist() + [0] * (seqs - b)
    assert padded.page_tables[b:].eq(-1).all()

    wider = pad_batch(batch, GraphBucket(tokens + 32, seqs + 8, 32), 12, MAX_MODEL_LEN)
    assert wider.flat is not batch.flat
    for field in ("input_ids", "positions", "slot_mapping", "block_ids", "cu_seqlens_q", "context_lens"):
        assert torch.equal(getattr(wider, field)[: getattr(padded, field).shape[0]], getattr(padded, field)), field
    assert wider.slot_mapping[tokens:].eq(-1).all() and wider.cu_seqlens_q[seqs:].eq(n).all()
    assert torch.equal(wider.page_tables[:seqs, :10], padded.page_tables) and wider.page_tables[:, 10:].eq(-1).all()


def test_the_flat_layout_aligns_every_input_and_overlaps_none():
    for tokens, seqs, columns in [(32, 1, 10), (33, 3, 7), (2048, 64, 18), (5, 1, 1)]:
        layout = flat_layout(tokens, seqs, columns)
        byte_spans = sorted((start * (8 if is_int64 else 4), end * (8 if is_int64 else 4))
                            for is_int64, start, end in layout.spans)
        assert all(start % 16 == 0 for start, _ in byte_spans)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(byte_spans, byte_spans[1:]))
        assert byte_spans[-1][1] <= 8 * layout.size


def test_to_device_on_the_cpu_gives_the_batch_and_its_host_lengths():
    batch = build(PLAN_SETS["mixed"])
    input_ids, positions, meta = batch.to_device(torch.device("cpu"))
    assert torch.equal(input_ids, batch.input_ids) and torch.equal(positions, batch.positions)
    assert torch.equal(meta.slot_mapping, batch.slot_mapping) and torch.equal(meta.page_tables, batch.page_tables)
    assert meta.cu_seqlens_q_host == (0, 6, 14, 15) and meta.context_lens_host == (0, 12, 3)


def test_ranges():
    assert ranges([3, 10, 7], [5, 10, 9]).tolist() == [3, 4, 7, 8]
    assert ranges([4], [4]).tolist() == []
