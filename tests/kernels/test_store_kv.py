"""The KV store kernel writes exactly the slots the reference writes, and leaves every other slot alone."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from diffulex_backend.attention import store_kv as store_kv_reference
from kernel_cases import DEVICE, FULL_SHAPES, assert_equal_after_rounding, generator, randn

NUM_TOKENS, KV_HEADS, NUM_PAGES = (2048, 8, 160) if FULL_SHAPES else (21, 3, 6)


def make_slots(num_tokens: int, page_size: int, seed: int) -> torch.Tensor:
    """Distinct random slots, with every fourth token skipped (-1)."""
    cpu_gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_PAGES * page_size, generator=cpu_gen)[:num_tokens]
    slots[::4] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_store_writes_slots_like_reference(page_size, head_dim):
    gen = generator(page_size + head_dim)
    # key and value are column slices of one fused projection, as the model produces them.
    qkv = randn(NUM_TOKENS, 3 * KV_HEADS * head_dim, dtype=torch.bfloat16, gen=gen)
    key = qkv[:, KV_HEADS * head_dim : 2 * KV_HEADS * head_dim].view(NUM_TOKENS, KV_HEADS, head_dim)
    value = qkv[:, 2 * KV_HEADS * head_dim :].view(NUM_TOKENS, KV_HEADS, head_dim)
    k_cache = randn(NUM_PAGES, page_size, KV_HEADS, head_dim, dtype=torch.bfloat16, gen=gen)
    v_cache = randn(NUM_PAGES, page_size, KV_HEADS, head_dim, dtype=torch.bfloat16, gen=gen)
    slots = make_slots(NUM_TOKENS, page_size, seed=page_size)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    diffulex_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_store_converts_to_the_cache_dtype():
    gen = generator(1)
    key = randn(NUM_TOKENS, KV_HEADS, 64, dtype=torch.float32, gen=gen)
    value = randn(NUM_TOKENS, KV_HEADS, 64, dtype=torch.float32, gen=gen)
    k_cache = randn(NUM_PAGES, 16, KV_HEADS, 64, dtype=torch.bfloat16, gen=gen)
    v_cache = randn(NUM_PAGES, 16, KV_HEADS, 64, dtype=torch.bfloat16, gen=gen)
    slots = make_slots(NUM_TOKENS, 16, seed=1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    diffulex_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert_equal_after_rounding(k_cache, k_ref)
    assert_equal_after_rounding(v_cache, v_ref)
