"""The KV store kernel writes exactly the slots the reference writes, and leaves every other slot alone."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import diffulex_kernels
from diffulex_kernels import kv_store
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_rows_hold_the_reference_s_values_and_scales_and_nothing_else_changes(head_dim, dtype):
    """Into a cache of FP8 rows each (token, head) row goes as the reference quantizes it: its values in
    float8_e4m3fn and its scale max|x| / 448, so the largest value is 448 and none saturates. Rows of very different
    sizes keep their own precision; an all-zero row stays zero; the bytes of every other slot stay as they were."""
    gen = generator(head_dim)
    key = randn(NUM_TOKENS, KV_HEADS, head_dim, dtype=torch.float32, gen=gen)
    key *= torch.logspace(-4, 4, NUM_TOKENS, device=DEVICE)[:, None, None]  # rows from 1e-4 to 1e4
    key[1, 1] = 0
    key = key.to(dtype)
    value = randn(NUM_TOKENS, KV_HEADS, head_dim, dtype=dtype, gen=gen)
    row = kv_store.fp8_row_bytes(head_dim)
    before = torch.randint(0, 256, (2, NUM_PAGES, 16, KV_HEADS, row), dtype=torch.uint8, device=DEVICE)
    k_cache, v_cache = before.clone()
    k_ref, v_ref = before.clone()
    slots = make_slots(NUM_TOKENS, 16, seed=head_dim)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    diffulex_kernels.store_kv(key, value, k_cache, v_cache, slots)
    written = slots >= 0
    for cache, ref, old, rows in ((k_cache, k_ref, before[0], key), (v_cache, v_ref, before[1], value)):
        # Each row's values and scale through the typed views, flat over (page, slot): the bytes they cover are the
        # whole cache, so "every other slot" covers every byte.
        (values, scales), (ref_values, ref_scales), (old_values, old_scales) = (
            (v.view(-1, KV_HEADS, head_dim), s.view(-1, KV_HEADS)) for v, s in map(kv_store.fp8_rows, (cache, ref, old)))
        assert values.numel() + 4 * scales.numel() == cache.numel()
        kept = torch.ones(values.shape[0], dtype=torch.bool, device=DEVICE)
        kept[slots[written]] = False
        assert torch.equal(values[kept].view(torch.uint8), old_values[kept].view(torch.uint8))
        assert torch.equal(scales[kept].view(torch.int32), old_scales[kept].view(torch.int32))
        values, scales = values[slots[written]], scales[slots[written]]
        ref_values, ref_scales = ref_values[slots[written]], ref_scales[slots[written]]
        # Equal as numbers (the CPU interpreter writes a negative value that rounds to zero as +0).
        assert torch.equal(values.float(), ref_values.float())
        assert torch.equal(scales, ref_scales)
        assert torch.equal(values.float().abs().amax(-1), torch.full_like(scales, 448).where(scales > 1e-14, 0))
        # Half a unit of 3 mantissa bits, or of the subnormals' 2^-9 step (times the row's scale) below 2^-6.
        error = (values.float() * scales[..., None] - rows[written].float()).abs()
        assert bool((error <= 2 ** -4 * rows[written].float().abs() + 2 ** -10 * scales[..., None]).all())
    assert written[1] and torch.equal(kv_store.fp8_rows(k_cache)[0].view(-1, KV_HEADS, head_dim)[slots[1]][1].float(),
                                      torch.zeros(head_dim, device=DEVICE))


def test_fp8_rows_lie_on_16_byte_boundaries_with_their_scales_after_every_row():
    """The layout the attention kernel's wide loads depend on: each row's values start a multiple of 16 bytes into
    the cache (head_dim 64 and 128 alike), and the scales follow every row's values."""
    for head_dim in (64, 128):
        cache = torch.zeros(3, 16, KV_HEADS, kv_store.fp8_row_bytes(head_dim), dtype=torch.uint8)
        values, scales = kv_store.fp8_rows(cache)
        assert values.data_ptr() == cache.data_ptr() and values.is_contiguous()
        assert all(stride % 16 == 0 for stride in values.stride()[:-1])
        assert scales.data_ptr() == cache.data_ptr() + values.numel() and scales.is_contiguous()
    with pytest.raises(ValueError, match="contiguous uint8"):
        kv_store.fp8_rows(cache[:, ::2])


def test_a_head_row_holding_nan_gets_a_nan_scale_and_the_heads_beside_it_are_untouched():
    """As the reference stores it: a NaN in one (token, head) row makes that row's scale and values NaN (Triton's
    maxima drop NaN on a GPU unless told otherwise, which would store finite values at full magnitude); the same
    token's other heads are quantized as ever."""
    head_dim = 64
    gen = generator(3)
    key = randn(NUM_TOKENS, KV_HEADS, head_dim, dtype=torch.bfloat16, gen=gen)
    value = randn(NUM_TOKENS, KV_HEADS, head_dim, dtype=torch.bfloat16, gen=gen)
    key[1, 0, 5] = float("nan")
    value[1, 1, 7] = float("inf")
    row = kv_store.fp8_row_bytes(head_dim)
    k_cache, v_cache = torch.zeros(2, NUM_PAGES, 16, KV_HEADS, row, dtype=torch.uint8, device=DEVICE)
    k_ref, v_ref = torch.zeros(2, NUM_PAGES, 16, KV_HEADS, row, dtype=torch.uint8, device=DEVICE)
    slots = make_slots(NUM_TOKENS, 16, seed=5)
    assert slots[1] >= 0
    store_kv_reference(key, value, k_ref, v_ref, slots)
    diffulex_kernels.store_kv(key, value, k_cache, v_cache, slots)
    for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        (values, scales), (ref_values, ref_scales) = (
            (v.view(-1, KV_HEADS, head_dim), s.view(-1, KV_HEADS)) for v, s in map(kv_store.fp8_rows, (cache, ref)))
        torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0, equal_nan=True)
        # Every byte where the reference holds a number (the zeros of a row over an infinite scale keep their sign);
        # NaN where it holds NaN, on the GPU: the interpreter casts a float32 NaN to a finite float8 value.
        number = ~ref_values.float().isnan()
        assert torch.equal(values.view(torch.uint8)[number], ref_values.view(torch.uint8)[number])
        if DEVICE.type == "cuda":
            assert torch.equal(values.float().isnan(), ref_values.float().isnan())
    k_scales = kv_store.fp8_rows(k_cache)[1].view(-1, KV_HEADS)[slots[1]]
    v_scales = kv_store.fp8_rows(v_cache)[1].view(-1, KV_HEADS)[slots[1]]
    assert k_scales[0].isnan() and k_scales[1:].isfinite().all()
    assert v_scales[1].isinf() and v_scales[0].isfinite()


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, kv_store._round_to_e4m3(tl.load(x_ptr + offsets, mask=mask)), mask=mask)


def test_rounding_to_e4m3_keeps_every_nan_a_nan_and_the_sign_of_every_zero():
    """The store rounds each quotient to e4m3 on its float32 bits before the cast. A GPU writes NaN as 0x7FFFFFFF
    (x86 as 0xFFC00000), whose carry in that rounding ran through the exponent into the sign: -0 in the cache where
    the reference holds NaN. Every NaN pattern stays NaN; -0, and a negative value that rounds to zero, stay -0 (a
    finite value over an infinite scale is one); the other values round as e4m3 does, bit for bit."""
    nan_bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, -4194304, 0x7F800001], dtype=torch.int32)  # -1: 0xFFFFFFFF
    values = torch.tensor([448.0, -448.0, 0.0, -0.0, -1.0 / 2048, 1.0 / 2048, 1.0 / 1024, -3.0 / 1024, 300.0, -17.0])
    x = torch.cat([nan_bits.view(torch.float32), values]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=16)
    assert out[:len(nan_bits)].isnan().all()
    want = values.to(torch.float8_e4m3fn).float().to(DEVICE)
    assert torch.equal(out[len(nan_bits):].view(torch.int32), want.view(torch.int32))  # the sign of a zero too


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-rows"])
@pytest.mark.parametrize("cache_heads, cache_dim", [(KV_HEADS - 1, 64), (KV_HEADS + 1, 64), (KV_HEADS, 32)],
                         ids=["fewer heads", "more heads", "shorter rows"])
def test_a_cache_whose_slots_do_not_hold_the_rows_is_refused_before_anything_is_written(cache_heads, cache_dim, fp8):
    """Keys of more heads than a slot holds, or longer rows, would write into the next slot or past the pool; the
    store refuses them, naming the shapes, and leaves the caches as they were."""
    gen = generator(9)
    key, value = (randn(NUM_TOKENS, KV_HEADS, 64, dtype=torch.bfloat16, gen=gen) for _ in range(2))
    caches = [randn(NUM_PAGES, 16, cache_heads, cache_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    if fp8:
        caches = [kv_store.pack_fp8_rows(cache) for cache in caches]
    before = [cache.clone() for cache in caches]
    with pytest.raises(ValueError, match=rf"store_kv: .* slots of {KV_HEADS} heads of 64 contiguous values"):
        kv_store.store_kv(key, value, caches[0], caches[1], make_slots(NUM_TOKENS, 16, 1))
    assert all(torch.equal(now, then) for now, then in zip(caches, before))


def store_case(seed: int, head_dim: int, fp8: bool):
    """(key, value, [k_cache, v_cache]) of NUM_TOKENS bfloat16 tokens and a cache of their shape, FP8 rows with fp8."""
    gen = generator(seed)
    key, value = (randn(NUM_TOKENS, KV_HEADS, head_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2))
    caches = [randn(NUM_PAGES, 16, KV_HEADS, head_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    return key, value, [kv_store.pack_fp8_rows(cache) for cache in caches] if fp8 else caches


def _bad_value(key, value, caches, slots):
    return key, value[:, :-1], caches, slots


def _bad_slots(key, value, caches, slots):
    return key, value, caches, slots[:-1]


def _bad_caches(key, value, caches, slots):
    return key, value, (caches[0], caches[1][:-1]), slots


def _strided_slots(key, value, caches, slots):
    return key, value, caches, torch.stack([slots, slots], 1)[:, 0]  # every other int64 of a wider tensor


def _float_slots(key, value, caches, slots):
    return key, value, caches, slots.float()


def _caches_of_two_dtypes(key, value, caches, slots):
    other = caches[1].view(torch.bfloat16) if caches[1].dtype == torch.uint8 else kv_store.pack_fp8_rows(caches[1])
    return key, value, (caches[0], other), slots


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-rows"])
@pytest.mark.parametrize("spoil, message", [
    (_bad_value, r"store_kv: value must be shaped as key"),
    (_bad_slots, rf"store_kv: slot_mapping must be \[{NUM_TOKENS}\] contiguous int32 or int64, got "
                 rf"\({NUM_TOKENS - 1},\)"),
    (_strided_slots, rf"store_kv: slot_mapping must be \[{NUM_TOKENS}\] contiguous .* of strides \(2,\)"),
    (_float_slots, r"store_kv: slot_mapping must be .* int32 or int64, got .* torch.float32"),
    (_bad_caches, r"store_kv: k_cache and v_cache need the same shapes"),
    (_caches_of_two_dtypes, r"store_kv: k_cache and v_cache must be of one dtype, got torch\.(uint8|bfloat16) and"),
], ids=["value of fewer heads", "slot mapping one short", "strided slot mapping", "float slot mapping",
        "v_cache one page short", "caches of two dtypes"])
def test_inputs_that_disagree_with_each_other_are_refused_before_anything_is_written(spoil, message, fp8):
    """A value of fewer heads than the key, a slot mapping shorter than the tokens, strided or of floats (the kernel
    reads it as a flat integer array), a V cache of fewer pages than the K cache, or an FP8-row cache beside one of
    the model's dtype would each read or write outside the slots they name; the store refuses them by name and
    writes nothing."""
    key, value, caches = store_case(10, 64, fp8)
    before = [cache.clone() for cache in caches]
    key, value, (k_cache, v_cache), slots = spoil(key, value, caches, make_slots(NUM_TOKENS, 16, 2))
    with pytest.raises(ValueError, match=message):
        kv_store.store_kv(key, value, k_cache, v_cache, slots)
    assert all(torch.equal(now, then) for now, then in zip(caches, before))


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-rows"])
def test_a_head_size_that_is_not_a_power_of_two_is_refused_by_name(fp8):
    """The store's tile spans head_dim values, a power of two: another head size gets a message naming it, not a
    compiler error, and nothing is written."""
    key, value, caches = store_case(11, 96, fp8)
    before = [cache.clone() for cache in caches]
    with pytest.raises(ValueError, match=r"store_kv: head_dim 96 is not a power of two"):
        kv_store.store_kv(key, value, caches[0], caches[1], make_slots(NUM_TOKENS, 16, 3))
    assert all(torch.equal(now, then) for now, then in zip(caches, before))
