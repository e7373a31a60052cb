"""Write the K/V of tokens into the paged cache at their slots (the kernel twin of `attention.store_kv`).

A cache is either of the model's dtype, or FP8 rows: a uint8 cache [..., head_dim + 4] whose bytes hold, for its
rows (every (page, slot, head) in order), first all the rows' `head_dim` values in float8_e4m3fn, then all their
float32 scales (`fp8_rows` gives the two typed views). Values apart from scales keep every row on a 16-byte
boundary, so the attention kernel reads a row in wide loads, as it reads a bf16 row; a scale after each row would
put rows 132 bytes apart, on 4-byte boundaries only, and make every load a quarter as wide. Each row has its own
scale, max|x| / 448, so no value of any head saturates and none is given up to a calibration; the row costs
head_dim + 4 bytes instead of 2 x head_dim in bf16.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .fp8_cast import FP8_MAX, abs_max
from .pdl import use_pdl, wait_for_previous_kernel

SCALE_BYTES = 4  # a row's float32 scale, after every row's values
MIN_AMAX = 1e-12  # an all-zero row keeps a finite scale
# A scale is max|x| times this float32 reciprocal, here and in the reference: a product rounds alike everywhere,
# where a division by a constant may be compiled into this product on one side and not on the other.
INV_FP8_MAX = 1.0 / FP8_MAX
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


def fp8_row_bytes(head_dim: int) -> int:
    return head_dim + SCALE_BYTES


def fp8_rows(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [..., head_dim] float8_e4m3fn, scales [...] float32): views of an FP8-row cache
    [..., head_dim + SCALE_BYTES] uint8, contiguous, whose bytes are its rows' values and then their scales."""
    if cache.dtype != torch.uint8 or not cache.is_contiguous():
        raise ValueError(f"fp8_rows: an FP8-row cache is contiguous uint8, got {cache.dtype} of strides "
                         f"{cache.stride()}")
    *shape, width = cache.shape
    head_dim = width - SCALE_BYTES
    values = math.prod(shape) * head_dim
    flat = cache.view(-1)
    return flat[:values].view(torch.float8_e4m3fn).view(*shape, head_dim), flat[values:].view(torch.float32).view(shape)


def typed_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, placeholder: torch.Tensor):
    """(k values, v values, k scales, v scales, the scales' strides) of a K/V cache pair, as a kernel takes them:
    an FP8-row pair's typed views (`fp8_rows`), or the caches themselves with `placeholder` for the scales and
    strides of 0, which a kernel never reads unless the rows are FP8."""
    if k_cache.dtype != torch.uint8:
        return k_cache, v_cache, placeholder, placeholder, (0, 0, 0)
    (k_values, k_scales), (v_values, v_scales) = fp8_rows(k_cache), fp8_rows(v_cache)
    return k_values, v_values, k_scales, v_scales, k_scales.stride()


def typed_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
                kv_heads: int, head_dim: int, name: str):
    """`typed_caches(k_cache, v_cache, slot_mapping)` for a store of `num_tokens` tokens' `kv_heads` rows of
    `head_dim` values, after refusing, by `name`, what would write outside the slots it names:
    - caches of two dtypes (an FP8-row cache beside one of the model's dtype);
    - a head_dim that is not a power of two (the store's and the attention's tiles are);
    - a slot mapping that is not one contiguous integer per token (the kernels read it as a flat array);
    - caches whose slots do not hold the rows (`check_slots`)."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k_cache and v_cache must be of one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if head_dim != triton.next_power_of_2(head_dim):
        raise ValueError(f"{name}: head_dim {head_dim} is not a power of two, which the cache's kernels (the store, "
                         "paged_attention) take")
    if (slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or (num_tokens > 1 and slot_mapping.stride(0) != 1)):
        raise ValueError(f"{name}: slot_mapping must be [{num_tokens}] contiguous int32 or int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype} of strides {slot_mapping.stride()}")
    typed = typed_caches(k_cache, v_cache, slot_mapping)
    check_slots(typed[0], typed[1], kv_heads, head_dim, name)
    return typed


def check_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int, name: str) -> None:
    """Raises unless typed caches (`typed_caches`) take a token's `kv_heads` rows of `head_dim` values in each slot:
    the same shapes and strides (a slot valid in one is valid in the other), contiguous rows, slots evenly strided
    across pages (a slot is flat over pages). A cache may be a column view of wider rows (DiffusionGemma's per-layer
    caches)."""
    if not all(cache.dim() == 4 and cache.shape == k_cache.shape and cache.shape[2:] == (kv_heads, head_dim)
               and cache.stride() == k_cache.stride()
               and cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1)
               for cache in (k_cache, v_cache)):
        raise ValueError(f"{name}: k_cache and v_cache need the same shapes and strides, and slots of {kv_heads} "
                         f"heads of {head_dim} contiguous values each, evenly strided across pages; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn, scales float32) of rows [..., head_dim], a scale per row: the reference of the
    kernel's store."""
    rows = rows.float()
    scales = rows.abs().amax(-1).clamp_min(MIN_AMAX) * INV_FP8_MAX
    return (rows / scales[..., None]).to(torch.float8_e4m3fn), scales


def pack_fp8_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [..., head_dim] as FP8 rows [..., head_dim + SCALE_BYTES] uint8, each quantized as the store writes it;
    into `out` when it is given. A few million rows at a time, so that no float32 copy of a whole pool is made."""
    if out is None:
        out = torch.empty(*rows.shape[:-1], fp8_row_bytes(rows.shape[-1]), dtype=torch.uint8, device=rows.device)
    values, scales = fp8_rows(out)
    values, scales, rows = values.view(-1, rows.shape[-1]), scales.view(-1), rows.reshape(-1, rows.shape[-1])
    step = max(1, (1 << 26) // rows.shape[-1])
    for start in range(0, rows.shape[0], step):
        values[start:start + step], scales[start:start + step] = quantize_rows(rows[start:start + step])
    return out


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448, or NaN) rounded to the nearest float8_e4m3fn value, ties to even, still in float32:
    the cast that follows is then exact wherever it runs (Triton's CPU interpreter rounds some values to the wrong
    binade). A negative value that rounds to zero, and -0, stay -0; a NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    # Normal: keep 3 of float32's 23 mantissa bits; a carry into the exponent is the right answer.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # ~0xFFFFF
    # Subnormal (below 2^-6): multiples of 2^-9, on the magnitude, then x's sign bit set on it, so that a zero keeps
    # its sign too: x < 0 is false for -0, and Triton negates as 0 - r, which is +0 for r = 0.
    y = tl.abs(x) * 512.0
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r) / 512.0
    subnormal = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # A NaN stays NaN: the GPU's NaN (all mantissa bits set) would carry through the exponent into the sign, -0.
    return tl.where(x != x, x, tl.where(tl.abs(x) < 0.015625, subnormal, normal))


@triton.jit
def kv_row_scale(amax):
    """A cached row's scale from its largest magnitude (float32): max|x| times 1/448, never below MIN_AMAX, as
    `quantize_rows` makes it; NaN where the row holds one."""
    return tl.maximum(amax, _MIN_AMAX, propagate_nan=tl.PropagateNan.ALL) * _INV_FP8_MAX


@triton.jit
def to_e4m3(x, scale):
    """x [rows, n] (float32) over its rows' scales [rows], in float8e4nv. Divided as IEEE (and torch) round it, not by
    the GPU's fast approximation, and rounded in float32 before the cast: the reference's e4m3 value everywhere."""
    return _round_to_e4m3(tl.math.div_rn(x, scale[:, None])).to(tl.float8e4nv)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_slot, stride_cache_head, stride_scale_slot, stride_scale_head,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    head_valid = heads < KV_HEADS
    mask = head_valid[:, None]
    # [BLOCK_H, HEAD_DIM]: one token's K (then V) for every kv head.
    src_k = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = slot.to(tl.int64) * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    scale_dst = slot.to(tl.int64) * stride_scale_slot + heads * stride_scale_head
    store_rows(tl.load(src_k, mask=mask), k_cache_ptr + dst, k_scale_ptr + scale_dst, mask, head_valid, FP8)
    store_rows(tl.load(src_v, mask=mask), v_cache_ptr + dst, v_scale_ptr + scale_dst, mask, head_valid, FP8)


@triton.jit
def store_rows(rows, row_dst, scale_dst, mask, is_row, FP8: tl.constexpr):
    """One token's K or V rows [heads, head_dim] into its cache slot (`row_dst`, pointers of the same shape; `mask`
    the values stored, `is_row` [heads] the rows): in the cache's dtype, or as FP8 rows, each cast with its own
    scale (to `scale_dst` [heads]) from its largest magnitude. The store launch and the RoPE launch that stores K/V
    (rotary.py) share it, so both write the same bytes."""
    if FP8:
        rows = rows.to(tl.float32)
        # A NaN in a row makes its scale NaN, as the reference's amax does (kernels/fp8_cast.py).
        scale = kv_row_scale(abs_max(rows, 1))
        tl.store(row_dst, to_e4m3(rows, scale), mask=mask)
        tl.store(scale_dst, scale, mask=is_row)
    else:
        tl.store(row_dst, rows.to(row_dst.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim], or FP8 rows (uint8, head_dim + 4)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 to skip a token
) -> None:
    """Copy each token's K/V into cache slot `slot_mapping[t]` (flat over pages); tokens at -1 are skipped. The
    caches may be column views of wider rows, as long as each head's values are contiguous. Into an FP8-row cache
    each (token, head) row goes with its own scale."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if value.shape != key.shape:
        raise ValueError(f"store_kv: value must be shaped as key, {tuple(key.shape)}; got {tuple(value.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("store_kv: key and value need a contiguous head_dim")
    fp8 = k_cache.dtype == torch.uint8
    k_cache, v_cache, k_scales, v_scales, scale_strides = typed_slots(k_cache, v_cache, slot_mapping, num_tokens,
                                                                      kv_heads, head_dim, "store_kv")
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        *scale_strides[1:],
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads), FP8=fp8,
        USE_PDL=use_pdl(key), num_warps=4, launch_pdl=use_pdl(key),
    )
