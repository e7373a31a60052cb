"""The decoder forward with Triton kernels (fused norms, in-place RoPE, SiLU-and-mul, paged attention, dmax's soft
input rows) gives the hidden states of the torch modules, over a paged cache written by an earlier forward."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from diffulex_backend.attention import AttentionMetadata, cache_rows
from diffulex_backend.models.decoder_lm import SoftInputs, TokenMerge
from diffulex_backend.runner import kv_cache_layout
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, random_model
from kernel_cases import DEVICE, REL_TOL, relative_error

PAGE_SIZE = 4
# float32 throughout; on the GPU the attention's matrix products run in tf32.
TOLERANCE = REL_TOL[torch.float32] if DEVICE.type == "cuda" else 1e-5


def metadata(query_lens, context_lens, block_ids, slot_mapping, page_tables) -> AttentionMetadata:
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        page_tables=torch.tensor(page_tables, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=DEVICE),
        block_ids=torch.tensor(block_ids, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(query_lens), max_context_len=max(context_lens),
        cu_seqlens_q_host=tuple(cu), context_lens_host=tuple(context_lens),
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("model_name", ["llada", "dream", "sdar"])  # plain, q/k/v bias + GQA, q/k norm
def test_fused_forward_matches_the_torch_modules(model_name, kv_cache_dtype):
    shape = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, head_dim=64)
    reference = random_model(model_name, **shape, device=DEVICE, seed=11)
    fused = random_model(model_name, **shape, device=DEVICE, seed=11, attention_fn=diffulex_kernels.paged_attention)
    fused.fused_kernels = True
    layout, cache_dtype = kv_cache_layout(reference, 8, PAGE_SIZE, torch.float32, kv_cache_dtype)
    caches = [torch.zeros(layout, dtype=cache_dtype, device=DEVICE) for _ in range(2)]
    # Over FP8 rows a value the two forwards compute a rounding apart may land on either side of an FP8 step.
    tolerance = TOLERANCE if kv_cache_dtype == "auto" else max(TOLERANCE, 2e-3)
    pages = [[0, 1, 2, 3], [4, 5, 6, 7]]

    # A causal prefill of two prompts (6 and 9 tokens) stores every token, then a decode step feeds an
    # 8-token block per sequence over that cached context, bidirectional inside the block, with dmax's soft
    # inputs on some of its rows.
    prefill = metadata([6, 9], [0, 0], list(range(6)) + list(range(9)),
                       [pages[0][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(6)]
                       + [pages[1][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(9)], pages)
    decode = metadata([8, 8], [6, 9], [6] * 8 + [9] * 8, [-1] * 16, pages)
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(16, 2, generator=gen) * 0.6
    weights = torch.tensor([1.0, 0.0, 0.5, 1.0] * 4)[:, None]  # 0: the row is its token
    soft = SoftInputs(torch.randint(0, 258, (16, 2), generator=gen).to(DEVICE),
                      torch.cat([probs, weights], 1).to(DEVICE), TokenMerge(MASK_TOKEN_ID, "dmax_topk", True, 2))
    steps = [
        (torch.randint(0, 258, (15,), generator=gen), torch.cat([torch.arange(6), torch.arange(9)]), prefill, None),
        (torch.full((16,), MASK_TOKEN_ID), torch.cat([torch.arange(6, 14), torch.arange(9, 17)]), decode, soft),
    ]
    with torch.inference_mode():
        for input_ids, positions, meta, soft_inputs in steps:
            want = reference(input_ids.to(DEVICE), positions.to(DEVICE), meta, caches[0], soft_inputs)
            got = fused(input_ids.to(DEVICE), positions.to(DEVICE), meta, caches[1], soft_inputs)
            assert relative_error(got, want) < tolerance
    slots = torch.arange(8 * PAGE_SIZE, device=DEVICE)
    stored = [torch.stack([cache_rows(cache[i, layer], slots) for i in range(2) for layer in range(cache.shape[1])])
              for cache in caches]
    assert relative_error(stored[1], stored[0]) < (TOLERANCE if kv_cache_dtype == "auto" else 1e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("model_name", ["llada", "dream", "sdar", "llada2"])
def test_the_rope_launch_stores_the_forward_s_k_and_v(model_name, kv_cache_dtype, monkeypatch):
    """Every family's forward writes K/V in its RoPE launch, over FP8 rows as over the model's dtype, so the
    attention launches no store of its own: SDAR's and LLaDA2's after their per-head q/k norms, in the same launch,
    and LLaDA2's with its partial rotary, whose unrotated values are stored too."""
    from diffulex_kernels import attention as attention_kernel

    shape = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, head_dim=64)
    fused = random_model(model_name, **shape, device=DEVICE, seed=5, attention_fn=diffulex_kernels.paged_attention)
    fused.fused_kernels = True
    layout, cache_dtype = kv_cache_layout(fused, 4, PAGE_SIZE, torch.float32, kv_cache_dtype)
    cache = torch.zeros(layout, dtype=cache_dtype, device=DEVICE)
    stores = []
    store_kv = attention_kernel.store_kv

    def counted_store(*args, **kwargs):
        stores.append(1)
        return store_kv(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "store_kv", counted_store)
    meta = metadata([5], [0], list(range(5)), list(range(5)), [[0, 1, 2, 3]])
    with torch.inference_mode():
        fused(torch.arange(5, device=DEVICE), torch.arange(5, device=DEVICE), meta, cache)
    assert not stores
    # Every token's K and V reached its slot in every layer, stored by the RoPE launch.
    for kind in range(2):
        for layer in range(2):
            assert cache_rows(cache[kind, layer], torch.arange(5, device=DEVICE)).abs().sum(-1).gt(0).all()
