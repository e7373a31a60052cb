"""RoPE in place matches the reference rotation, on q and k side by side in a fused qkv buffer."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend.layers.rotary import apply_rotary, rotary_angles
from diffulex_kernels.kv_store import fp8_row_bytes, fp8_rows, pack_fp8_rows, store_kv
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-rows"])
@pytest.mark.parametrize("shape", [*SHAPES, (3, 8, 72, 64)], ids=str)  # and more kv heads than a head tile holds
def test_rotate_and_store_kv_equals_rotate_then_store(shape, fp8, dtype):
    """The fused launch leaves qkv and both caches as `rotate_in_place` then `store_kv` leave them, byte for byte:
    into FP8 rows too, each row's e4m3 values and its scale."""
    tokens, heads, kv_heads, head_dim = shape
    gen = generator(tokens * heads + 1)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    cos, sin = rotary_angles(torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE), head_dim, 10000.0)
    page_size = 16
    num_pages = tokens // page_size + 2  # room for every token's slot, and slots no token writes
    caches = [randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen) for _ in range(2)]
    if fp8:
        caches = [pack_fp8_rows(cache) for cache in caches]
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


def test_a_row_holding_nan_stored_as_fp8_gets_a_nan_scale_and_the_rows_beside_it_are_untouched():
    """As `store_kv` stores it: a NaN in one k head's row, in either half the rotation splits it into, and an
    infinity in one v head's row, give those rows a NaN and an infinite scale; the token's other heads are cast as
    ever."""
    tokens, heads, kv_heads, head_dim = 2, 4, 2, 64
    gen = generator(11)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, gen=gen)
    k_first = heads * head_dim
    qkv[0, k_first + head_dim + 40] = float("nan")  # token 0, k head 1, the second half
    qkv[1, k_first + 3] = float("nan")  # token 1, k head 0, the first half
    qkv[1, (heads + kv_heads) * head_dim + head_dim + 9] = float("inf")  # token 1, v head 1
    cos, sin = rotary_angles(torch.tensor([3, 9], device=DEVICE), head_dim, 10000.0)
    k_cache, v_cache = (torch.zeros(1, 16, kv_heads, fp8_row_bytes(head_dim), dtype=torch.uint8, device=DEVICE)
                        for _ in range(2))
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    rotate_and_store_kv(qk, v, cos, sin, k_cache, v_cache, torch.tensor([4, 7], device=DEVICE))
    k_scales, v_scales = fp8_rows(k_cache)[1].view(16, kv_heads), fp8_rows(v_cache)[1].view(16, kv_heads)
    assert k_scales[4, 1].isnan() and k_scales[4, 0].isfinite()
    assert k_scales[7, 0].isnan() and k_scales[7, 1].isfinite()
    assert v_scales[7, 1].isinf() and v_scales[7, 0].isfinite() and v_scales[4].isfinite().all()
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[4, 7]] = False
    assert (k_scales[untouched] == 0).all() and (v_scales[untouched] == 0).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-rows"])
@pytest.mark.parametrize("wrong", ["more kv heads than the cache", "fewer kv heads than the cache",
                                   "another head_dim", "short slot mapping", "kv heads not fewer than qk's"])
def test_rotate_and_store_kv_refuses_what_its_caches_do_not_hold_and_writes_nothing(wrong, fp8):
    """A value whose heads or head size the caches do not hold, or a slot mapping of another length, would write
    past the slots it names: the call refuses it with a message naming the shapes, and leaves qk and the caches
    as they were."""
    tokens, heads, kv_heads, head_dim = 4, 4, 2, 64
    gen = generator(5)
    qk = randn(tokens, heads + kv_heads, head_dim, dtype=torch.bfloat16, gen=gen)
    value = randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, gen=gen)
    cache_heads, cache_dim, slots = kv_heads, head_dim, tokens
    if wrong == "more kv heads than the cache":
        cache_heads = 1
    elif wrong == "fewer kv heads than the cache":
        cache_heads = 3
    elif wrong == "another head_dim":
        cache_dim = 32
    elif wrong == "short slot mapping":
        slots = tokens - 1
    else:
        value = randn(tokens, heads + kv_heads, head_dim, dtype=torch.bfloat16, gen=gen)
    caches = [randn(2, 16, cache_heads, cache_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    if fp8:
        caches = [pack_fp8_rows(cache) for cache in caches]
    before = [qk.clone(), *(c.clone() for c in caches)]
    cos, sin = rotary_angles(torch.arange(tokens, device=DEVICE), head_dim, 10000.0)
    with pytest.raises(ValueError, match=r"rotate_and_store_kv: (value|slot_mapping|k_cache)"):
        rotate_and_store_kv(qk, value, cos, sin, caches[0], caches[1], torch.arange(slots, device=DEVICE))
    assert all(torch.equal(now, then) for now, then in zip([qk, *caches], before))
