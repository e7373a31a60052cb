"""RoPE in place matches the reference rotation, on q and k side by side in a fused qkv buffer: whole heads, or each
head's first rotary_dim values (partial rotary), after a per-head RMSNorm or without one."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend.layers.rotary import apply_rotary, rotary_angles
from diffulex_kernels.kv_store import fp8_row_bytes, fp8_rows, pack_fp8_rows, store_kv
from diffulex_kernels.rotary import HeadNorm, rotate_and_store_kv, rotate_in_place
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


def head_norm(num_q_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> HeadNorm:
    """Weights about 1 with a spread, in the model's dtype, as a checkpoint's q_norm and k_norm hold them."""
    q_weight, k_weight = (1 + 0.3 * randn(head_dim, dtype=torch.float32, gen=gen) for _ in range(2))
    return HeadNorm(q_weight.to(dtype), k_weight.to(dtype), 1e-6, num_q_heads)


def normed_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head RMSNormed in float32 with its weight, rounded once to x's dtype (the kernel's rounding; the torch
    module rounds before it multiplies by the weight too)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape, rotary_dim", [((5, 16, 4, 128), 128), ((5, 16, 4, 128), 64), ((3, 6, 2, 96), 64),
                                               ((3, 6, 2, 112), 64), ((4, 3, 1, 64), 64), ((4, 3, 1, 64), 32),
                                               ((4, 3, 1, 128), 32)], ids=str)
def test_the_head_norm_and_a_partial_rotary_match_the_reference(shape, rotary_dim, dtype, normed):
    """Each head's first rotary_dim values rotate (LLaDA2's partial_rotary_factor 0.5: its first half) and the rest
    pass through, after the per-head q/k norms when the model has them (SDAR, LLaDA2, DreamReasoner), with q's
    weight on q's heads and k's on k's, every head of q and k in one launch: as `apply_rotary` after the norm in
    float32 rounded once (`normed_reference`). A head of 96 values passes a tail of 32 through unrotated, one of 112
    a tail of 48, narrower than its power-of-two tile; one head of the first token is so small that the norm's eps
    outweighs its squares; v is untouched."""
    tokens, heads, kv_heads, head_dim = shape
    gen = generator(tokens * head_dim + rotary_dim + int(normed))
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen) * 3
    qkv[0, :head_dim] *= 1e-4  # squares about 1e-7 a value, against eps 1e-6
    cos, sin = rotary_angles(torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE), rotary_dim, 10000.0)
    norm = head_norm(heads, head_dim, dtype, gen) if normed else None
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    if normed:
        q, k = normed_reference(q, norm.q_weight, norm.eps), normed_reference(k, norm.k_weight, norm.eps)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rotate_in_place(qk, cos, sin, norm)

    got_q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    got_k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    # In bfloat16 a value rounds twice, normed and rotated, and the rotation mixes two normed values: a few units in
    # the last place of the head's largest value (the interpreter truncates where a GPU rounds to nearest, so up to
    # twice a GPU's error; kernel_cases.assert_equal_after_rounding). In float32, rounding. A weight of the other
    # projection, or a norm over the wrong values, is off by tenths.
    tolerance = 2.0**-5 if dtype == torch.bfloat16 else 1e-5
    for got, expected in ((got_q, expected_q), (got_k, expected_k)):
        largest = expected.float().abs().amax(-1, keepdim=True)
        assert ((got.float() - expected.float()).abs() <= tolerance * largest).all()
        assert relative_error(got, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    if not normed:  # nothing rounds the values past rotary_dim: they are the very same
        assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
        assert torch.equal(got_k[..., rotary_dim:], k[..., rotary_dim:])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


def test_a_norm_or_rotary_dim_that_does_not_fit_the_heads_is_refused():
    """The norm's weights must be a head long, and its q heads within x's: else it would read past the weights or
    give q's weight to k's heads. Refused by name, and x is left as it was."""
    gen = generator(3)
    x = randn(2, 3, 64, dtype=torch.bfloat16, gen=gen)
    before = x.clone()
    cos, sin = rotary_angles(torch.arange(2, device=DEVICE), 64, 10000.0)
    short = HeadNorm(torch.ones(32, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6, 2)
    with pytest.raises(ValueError, match=r"rotate_in_place: the norm's weights must be contiguous \[64\]"):
        rotate_in_place(x, cos, sin, short)
    too_many = HeadNorm(torch.ones(64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6, 4)
    with pytest.raises(ValueError, match=r"num_q_heads \(4\) must be within x's 3 heads"):
        rotate_in_place(x, cos, sin, too_many)
    wide = rotary_angles(torch.arange(2, device=DEVICE), 128, 10000.0)
    with pytest.raises(ValueError, match=r"rotary_dim is at most head_dim \(64\)"):
        rotate_in_place(x, *wide)
    assert torch.equal(x, before)


@pytest.mark.parametrize("head", ["whole", "normed", "normed-partial", "partial"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-rows"])
@pytest.mark.parametrize("shape", [*SHAPES, (3, 8, 72, 64)], ids=str)  # and more kv heads than a head tile holds
def test_rotate_and_store_kv_equals_rotate_then_store(shape, fp8, dtype, head):
    """The fused launch stores the k heads it leaves in qkv, and v, as `store_kv` stores them, byte for byte: into
    FP8 rows too, each row's e4m3 values and its scale; with each head normed first, and with a partial rotary whose
    unrotated values are stored too. It leaves qkv as `rotate_in_place` does: byte for byte without a norm, within
    a unit of rounding with one."""
    tokens, heads, kv_heads, head_dim = shape
    gen = generator(tokens * heads + 1)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    # LLaDA2's half of each head under its norms; a quarter without, whose 3/4 of unrotated values are narrower than
    # the power-of-two tile that holds them.
    rotary_dim = {"normed-partial": head_dim // 2, "partial": head_dim // 4}.get(head, head_dim)
    cos, sin = rotary_angles(torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE), rotary_dim, 10000.0)
    norm = head_norm(heads, head_dim, dtype, gen) if "normed" in head else None
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

    rotated = qkv.clone()
    rotate_in_place(split(rotated)[0], cos, sin, norm)
    expected_k_cache, expected_v_cache = (c.clone() for c in caches)

    qk, k, v = split(qkv)
    rotate_and_store_kv(qk, v, cos, sin, caches[0], caches[1], slot_mapping, norm)
    store_kv(k, v, expected_k_cache, expected_v_cache, slot_mapping)  # what the call left in qkv, stored alone
    assert torch.equal(caches[0], expected_k_cache)  # stored slots hold the k it left, the others are untouched
    assert torch.equal(caches[1], expected_v_cache)
    if norm is None:
        assert torch.equal(qkv, rotated)
    else:
        # On a GPU the launch compiled with the store and the one without it differ by about a unit in the last
        # place under a norm (their float arithmetic compiles apart); bit for bit without one.
        ulp = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
        largest = rotated.float().abs().amax(-1, keepdim=True)
        assert ((qkv.float() - rotated.float()).abs() <= 2 * ulp * largest).all()


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
                                   "another head_dim", "short slot mapping", "kv heads not fewer than qk's",
                                   "a norm over other q heads", "a head size that is not a power of two"])
def test_rotate_and_store_kv_refuses_what_its_caches_do_not_hold_and_writes_nothing(wrong, fp8):
    """A value whose heads or head size the caches do not hold, or a slot mapping of another length, would write
    past the slots it names: the call refuses it with a message naming the shapes, and leaves qk and the caches
    as they were."""
    tokens, heads, kv_heads, head_dim = 4, 4, 2, 96 if wrong == "a head size that is not a power of two" else 64
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
    elif wrong == "kv heads not fewer than qk's":
        value = randn(tokens, heads + kv_heads, head_dim, dtype=torch.bfloat16, gen=gen)
    norm = HeadNorm(torch.ones(head_dim, device=DEVICE), torch.ones(head_dim, device=DEVICE), 1e-6,
                    heads - kv_heads + 1) if wrong == "a norm over other q heads" else None
    caches = [randn(2, 16, cache_heads, cache_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    if fp8:
        caches = [pack_fp8_rows(cache) for cache in caches]
    before = [qk.clone(), *(c.clone() for c in caches)]
    cos, sin = rotary_angles(torch.arange(tokens, device=DEVICE), 64, 10000.0)
    with pytest.raises(ValueError, match=r"rotate_and_store_kv: (value|slot_mapping|k_cache|the norm's num_q_heads|"
                                         r"head_dim 96)"):
        rotate_and_store_kv(qk, value, cos, sin, caches[0], caches[1], torch.arange(slots, device=DEVICE), norm)
    assert all(torch.equal(now, then) for now, then in zip([qk, *caches], before))
