"""Paged attention captured once in a CUDA graph serves later steps whose metadata changed in place."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from diffulex_backend.attention import paged_attention_reference
from diffulex_kernels.attention import plan_launch
from kernel_cases import REL_TOL, relative_error
from test_paged_attention import HEAD_SHAPES, SEQUENCES, make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("num_splits", [1, 4], ids=["one_split", "split_kv"])
def test_graph_replay_follows_new_lengths_and_pages(num_splits):
    heads, kv_heads = HEAD_SHAPES[7]
    captured = make_batch(heads=heads, kv_heads=kv_heads, head_dim=128, page_size=32, dtype=torch.bfloat16, pattern="blocks", seed=1)
    # The next step: shorter contexts and queries (within the captured bounds), other pages, other values.
    shorter = [(max(q - 3, 0), c // 2) for q, c in SEQUENCES]
    step = make_batch(
        heads=heads, kv_heads=kv_heads, head_dim=128, page_size=32, dtype=torch.bfloat16, pattern="causal", seed=2,
        sequences=shorter,
    )
    meta = captured.meta
    launch = plan_launch(captured.query, captured.key, meta, num_splits=num_splits)
    scale = 128**-0.5
    out = torch.empty_like(captured.query)

    def forward():
        diffulex_kernels.paged_attention(
            captured.query, captured.key, captured.value, captured.k_cache, captured.v_cache, meta, scale,
            out=out, launch=launch,
        )

    forward()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    num_tokens = step.query.shape[0]
    for name in ("query", "key", "value"):
        getattr(captured, name).zero_()[:num_tokens] = getattr(step, name)
    captured.k_cache[: step.k_cache.shape[0]] = step.k_cache
    captured.v_cache[: step.v_cache.shape[0]] = step.v_cache
    meta.cu_seqlens_q.copy_(step.meta.cu_seqlens_q)
    meta.context_lens.copy_(step.meta.context_lens)
    meta.page_tables.fill_(-1)[:, : step.meta.page_tables.shape[1]] = step.meta.page_tables
    meta.slot_mapping.fill_(-1)[:num_tokens] = step.meta.slot_mapping
    meta.block_ids.zero_()[:num_tokens] = step.meta.block_ids
    out.fill_(float("nan"))
    graph.replay()

    ref = paged_attention_reference(
        step.query, step.key, step.value, step.k_cache, step.v_cache, step.meta, scale
    )
    assert torch.isfinite(out[:num_tokens]).all()
    assert relative_error(out[:num_tokens], ref) < REL_TOL[torch.bfloat16]
    torch.cuda.synchronize()
    assert torch.equal(captured.k_cache[: step.k_cache.shape[0]], step.k_cache)
