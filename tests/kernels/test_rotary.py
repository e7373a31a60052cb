"""RoPE in place matches the reference rotation, on q and k side by side in a fused qkv buffer."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend.layers.rotary import apply_rotary, rotary_angles
from diffulex_kernels.kv_store import store_kv
from diffulex_kernels.rotary import rotate_and_store_kv, rotate_in_place
from kernel_cases import DEVICE, FULL_SHAPES, generator, randn, relative_error

# (tokens, heads, kv_heads, head_dim): LLaDA-8B and Dream-7B, or small ones with a ragged head tile.
SHAPES = [(2048, 32, 32, 128), (2048, 28, 4, 128)] if FULL_SHAPES else [(5, 4, 2, 64), (3, 40, 30, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_q_and_k_rotate_in_one_launch_and_v_is_untouched(shape, dtype):
    tokens, heads, kv_heads, head_dim = shape
    gen = generator(tokens + heads)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE)
    cos, sin = rotary_angles(positions, head_dim, 10000.0)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rotate_in_place(qk, cos, sin)

    rotated_q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    rotated_k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert relative_error(rotated_q, expected_q) < tolerance
    assert relative_error(rotated_k, expected_k) < tolerance
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


def test_float32_rotation_is_the_reference_rotation():
    tokens, heads, head_dim = 6, 3, 64
    gen = generator(7)
    x = randn(tokens, heads, head_dim, dtype=torch.float32, gen=gen)
    cos, sin = rotary_angles(torch.arange(100, 100 + tokens, device=DEVICE), head_dim, 500000.0)
    expected = apply_rotary(x, cos, sin)
    rotate_in_place(x, cos, sin)
    assert relative_error(x, expected) < 1e-6


def test_bfloat16_rotation_rounds_like_the_reference():
    tokens, heads, head_dim = 4, 2, 128
    gen = generator(8)
    x = randn(tokens, heads, head_dim, dtype=torch.bfloat16, gen=gen)
    cos, sin = rotary_angles(torch.arange(tokens, device=DEVICE), head_dim, 10000.0)
    expected = apply_rotary(x, cos, sin)
    rotate_in_place(x, cos, sin)
    # The float32 arithmetic may fuse a multiply-add, so allow one unit in the last place of bfloat16.
    one_ulp = expected.float().abs() * 2.0**-7 + 1e-30
    assert ((x.float() - expected.float()).abs() <= one_ulp).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rotate_and_store_kv_equals_rotate_then_store(shape):
    tokens, heads, kv_heads, head_dim = shape
    gen = generator(tokens * heads + 1)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, gen=gen)
    cos, sin = rotary_angles(torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE), head_dim, 10000.0)
    page_size = 16
    num_pages = tokens // page_size + 2  # room for every token's slot, and slots no token writes
    caches = [randn(num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    slots = torch.randperm(num_pages * page_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    slots[::2] = -1  # every other token keeps no K/V (a block still in flight)
    slot_mapping = slots.to(DEVICE)

    def split(buffer):
        qk = buffer[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
        return qk, qk[:, heads:], buffer[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)

    expected_qkv, (expected_k_cache, expected_v_cache) = qkv.clone(), [c.clone() for c in caches]
    qk, k, v = split(expected_qkv)
    rotate_in_place(qk, cos, sin)
    store_kv(k, v, expected_k_cache, expected_v_cache, slot_mapping)

    qk, _, v = split(qkv)
    rotate_and_store_kv(qk, v, cos, sin, caches[0], caches[1], slot_mapping)
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(caches[0], expected_k_cache)  # stored slots hold the rotated k, the others are untouched
    assert torch.equal(caches[1], expected_v_cache)
