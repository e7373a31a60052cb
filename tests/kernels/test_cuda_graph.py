"""Paged attention captured once in a CUDA graph serves later steps whose metadata changed in place, and an engine's
graphs captured while it serves hold their outputs and nothing more."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import paged_attention_reference
from diffulex_backend.cuda_graph import GraphBucket
from diffulex_backend.testing.checkpoint import write_random_checkpoint
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


def test_graphs_captured_while_serving_hold_their_outputs_and_nothing_more(tmp_path):
    """A bucket first met while serving captures its graph then, and the memory allocated grows by the graph's
    output only: the eager run before the capture goes on the runner's one capture stream, whose cuBLAS workspace
    (32 MiB on Hopper) the warm-up's graphs of more than 64 rows have made already. (An eager run on a stream
    PyTorch had not yet run cuBLAS on would hold one more workspace.)"""
    checkpoint = write_random_checkpoint(tmp_path / "llada", "llada", hidden_size=128, num_heads=2, num_kv_heads=2,
                                         head_dim=64, intermediate_size=256)
    engine = Diffulex(str(checkpoint), device="cuda", dtype="bfloat16", block_size=32, page_size=16,
                      max_model_len=256, max_num_reqs=8, num_kv_pages=64)  # warmed up: its buckets are captured
    for prompt in ("the first prompt", "a second one"):
        engine.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    engine.step()  # the prompts' prefill; the next step decodes over a cached context
    batch = engine.runner.build_batch(engine.scheduler.schedule().plans)
    forward = engine.runner.padded_forward
    # Past 64 rows the products go to cuBLAS, and no warm-up step pads to these.
    buckets = [GraphBucket(tokens, 8, 64) for tokens in (160, 192, 224)]
    assert batch.num_tokens <= 160 and not any((bucket, False) in forward.graphs for bucket in buckets)
    with torch.inference_mode():
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        for bucket in buckets:
            forward.run(bucket, batch)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - allocated
    outputs = sum(-(-forward.graphs[(bucket, False)][1].untyped_storage().nbytes() // 512) * 512
                  for bucket in buckets)  # the caching allocator's 512-byte rounding
    assert 0 < outputs and grown <= outputs, f"{grown} bytes held for {len(buckets)} graphs' outputs of {outputs}"
