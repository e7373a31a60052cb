"""Rotary position embedding applied in place: the kernel twin of `diffulex_backend.layers.rotary.apply_rotary`.

A program rotates a tile of up to 64 heads of one token, so a decoder layer rotates q and k together in one launch
when they sit side by side in the fused qkv projection's output (a [T, heads + kv_heads, head_dim] view of it).
The rotation runs in float32 from the float32 cos/sin of `rotary_angles`, as the reference does; a partial rotary
(LLaDA2) rotates each head's first rotary_dim values and passes the rest through. Models with per-head q/k norms
(SDAR, LLaDA2, DreamReasoner) norm each head in the same launch before it rotates (`HeadNorm`): in float32, rounded
once to the heads' dtype, where the torch module (`diffulex_backend.layers.norm.RMSNorm`) also rounds before it
multiplies by the weight.
`rotate_and_store_kv` also writes the K and the V of tokens with a cache slot, in the same launch, into a
cache of the model's dtype or of FP8 rows (each row cast with its own scale, as `kv_store.store_kv` casts it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_store import store_rows, typed_slots
from .pdl import use_pdl, wait_for_previous_kernel


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    q_weight_ptr, k_weight_ptr, eps,
    stride_xt, stride_xh, stride_cos, stride_sin, stride_vt, stride_vh, stride_cache_slot, stride_cache_head,
    stride_scale_slot, stride_scale_head, num_heads, num_q_heads,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE_KV: tl.constexpr, FP8: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token and tile of heads. A head is three pieces: the two halves that rotate (HALF values
    each) and the PASS values after them that do not (partial rotary). With NORM each head is RMSNormed first, q's
    heads with q's weight and k's with k's, and rounded to x's dtype before it rotates, as a norm launch and a
    rotary launch would leave it."""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    first_head = tl.program_id(1) * BLOCK_H
    heads = first_head + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
    in_head = rest < 2 * HALF + PASS
    mask = (heads < num_heads)[:, None]
    rest_mask = mask & in_head[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + dims)[None, :]  # [1, HALF] float32
    sin = tl.load(sin_ptr + token * stride_sin + dims)[None, :]
    head_ptrs = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    first = head_ptrs + dims[None, :]  # [BLOCK_H, HALF]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    if PASS > 0:
        x3 = tl.load(head_ptrs + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32)
    if NORM:
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS > 0:
            squares += tl.sum(x3 * x3, axis=1)
        inv_rms = tl.rsqrt(squares / (2 * HALF + PASS) + eps)[:, None]
        is_q = (heads < num_q_heads)[:, None]
        every = dims < HALF
        x1 = _normed(x1, inv_rms, is_q, q_weight_ptr, k_weight_ptr, dims, every, x_ptr.dtype.element_ty)
        x2 = _normed(x2, inv_rms, is_q, q_weight_ptr, k_weight_ptr, HALF + dims, every, x_ptr.dtype.element_ty)
        if PASS > 0:
            x3 = _normed(x3, inv_rms, is_q, q_weight_ptr, k_weight_ptr, rest, in_head, x_ptr.dtype.element_ty)
            tl.store(head_ptrs + rest[None, :], x3.to(x_ptr.dtype.element_ty), mask=rest_mask)
    rotated1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    rotated2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(first, rotated1, mask=mask)
    tl.store(first + HALF, rotated2, mask=mask)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            cache_slot = slot.to(tl.int64) * stride_cache_slot
            scale_slot = slot.to(tl.int64) * stride_scale_slot
            kv_heads = tl.arange(0, BLOCK_KV)
            head_dims = tl.arange(0, BLOCK_D)
            in_row = (head_dims < 2 * HALF + PASS)[None, :]
            # The k heads follow the q heads. This program's are read back whole from x once every thread's stores
            # are done, and stored as V is: the cache holds what x holds, and an FP8 row's scale is one reduction
            # over that whole row.
            k_head = num_q_heads + kv_heads
            is_k = (kv_heads < KV_HEADS) & (k_head >= first_head) & (k_head < first_head + BLOCK_H)
            tl.debug_barrier()
            row_dst = cache_slot + kv_heads[:, None] * stride_cache_head + head_dims[None, :]
            scale_dst = scale_slot + kv_heads * stride_scale_head
            k_mask = is_k[:, None] & in_row
            k = tl.load(x_ptr + token * stride_xt + k_head[:, None] * stride_xh + head_dims[None, :], mask=k_mask,
                        other=0.0)
            store_rows(k, k_cache_ptr + row_dst, k_scale_ptr + scale_dst, k_mask, is_k, FP8)
            if tl.program_id(1) == 0:
                is_v = kv_heads < KV_HEADS
                v_mask = is_v[:, None] & in_row
                v = tl.load(v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + head_dims[None, :],
                            mask=v_mask, other=0.0)
                store_rows(v, v_cache_ptr + row_dst, v_scale_ptr + scale_dst, v_mask, is_v, FP8)


@triton.jit
def _normed(x, inv_rms, is_q, q_weight_ptr, k_weight_ptr, cols, valid, dtype: tl.constexpr):
    """x's columns `cols` (those `valid`) normed by inv_rms with q's or k's weight, rounded to dtype, back in
    float32."""
    q_weight = tl.load(q_weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
    k_weight = tl.load(k_weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
    return (x * inv_rms * tl.where(is_q, q_weight, k_weight)).to(dtype).to(tl.float32)


@dataclass(frozen=True, eq=False)
class HeadNorm:
    """Each head's RMSNorm before it rotates (SDAR, LLaDA2, DreamReasoner): q's weight on the first `num_q_heads`
    heads, k's on the rest, in float32, the result rounded to the heads' dtype."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    num_q_heads: int


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: HeadNorm | None, name: str) -> None:
    num_tokens, heads, head_dim = x.shape
    half = cos.shape[-1] if cos.dim() == 2 else -1
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"{name}: x, cos and sin need a contiguous last dimension")
    if (half < 1 or half != triton.next_power_of_2(half) or 2 * half > head_dim or cos.shape != (num_tokens, half)
            or sin.shape != cos.shape):
        raise ValueError(f"{name}: cos and sin must be [{num_tokens}, rotary_dim // 2], where rotary_dim is at most "
                         f"head_dim ({head_dim}) and twice a power of two; got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if norm is not None:
        if not all(w.shape == (head_dim,) and w.stride(-1) == 1 for w in (norm.q_weight, norm.k_weight)):
            raise ValueError(f"{name}: the norm's weights must be contiguous [{head_dim}], got "
                             f"{tuple(norm.q_weight.shape)} and {tuple(norm.k_weight.shape)}")
        if not 0 <= norm.num_q_heads <= heads:
            raise ValueError(f"{name}: the norm's num_q_heads ({norm.num_q_heads}) must be within x's {heads} heads")


def _launch(x, cos, sin, norm: HeadNorm | None, store: tuple | None) -> None:
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    half = cos.shape[-1]
    rest = head_dim - 2 * half
    block_h = min(64, triton.next_power_of_2(num_heads))
    fp8 = store is not None and store[1].dtype == torch.uint8
    if store is None:
        value = k_cache = v_cache = k_scales = v_scales = slot_mapping = x  # never read: STORE_KV=False
        v_strides, cache_strides, scale_strides, kv_heads = (0, 0), (0, 0), (0, 0), 1
    else:
        value, k_cache, v_cache, slot_mapping = store
        k_cache, v_cache, k_scales, v_scales, (_, *scale_strides) = typed_slots(
            k_cache, v_cache, slot_mapping, num_tokens, value.shape[1], head_dim, "rotate_and_store_kv")
        v_strides, cache_strides = (value.stride(0), value.stride(1)), (k_cache.stride(1), k_cache.stride(2))
        kv_heads = value.shape[1]
    # Without a norm its weights are never read (NORM=False); the q heads are those before the kv heads.
    q_weight, k_weight, eps = (x, x, 0.0) if norm is None else (norm.q_weight, norm.k_weight, norm.eps)
    num_q_heads = num_heads - kv_heads if norm is None else norm.num_q_heads
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, cos, sin, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, q_weight, k_weight, eps,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), *v_strides, *cache_strides, *scale_strides,
        num_heads, num_q_heads,
        HALF=half, PASS=rest, BLOCK_PASS=triton.next_power_of_2(max(rest, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), NORM=norm is not None, BLOCK_H=block_h,
        STORE_KV=store is not None, FP8=fp8, KV_HEADS=kv_heads, BLOCK_KV=triton.next_power_of_2(kv_heads),
        USE_PDL=use_pdl(x), num_warps=4, launch_pdl=use_pdl(x),
    )


def rotate_in_place(
    x: torch.Tensor,  # [T, heads, head_dim], any token and head strides, contiguous head_dim
    cos: torch.Tensor,  # [T, rotary_dim // 2] float32
    sin: torch.Tensor,  # [T, rotary_dim // 2] float32
    norm: HeadNorm | None = None,
) -> torch.Tensor:
    """Rotate `x` in place (rotate-half layout over each head's first rotary_dim values; the rest pass through)
    and return it; with `norm`, each head is RMSNormed first."""
    _check(x, cos, sin, norm, "rotate_in_place")
    _launch(x, cos, sin, norm, None)
    return x


def rotate_and_store_kv(
    qk: torch.Tensor,  # [T, heads + kv_heads, head_dim]: q's heads then k's, as in the fused qkv output
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim // 2] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim], contiguous, or FP8 rows (kv_store.py)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 to skip a token
    norm: HeadNorm | None = None,
) -> None:
    """`rotate_in_place(qk, norm=norm)`, then `store_kv` of the k heads as left in qk and of `value`, in one
    launch: a decoder layer stores its committed blocks' K/V without a launch of its own. Into FP8 rows the values
    and scales are `store_kv`'s, bit for bit."""
    _check(qk, cos, sin, norm, "rotate_and_store_kv")
    num_tokens, heads, head_dim = qk.shape
    if value.dim() != 3 or value.shape[0] != num_tokens or value.shape[2] != head_dim or value.shape[1] >= heads:
        raise ValueError(f"rotate_and_store_kv: value must be [{num_tokens}, kv_heads, {head_dim}] with fewer kv "
                         f"heads than qk's {heads}, got {tuple(value.shape)}")
    if norm is not None and norm.num_q_heads != heads - value.shape[1]:
        raise ValueError(f"rotate_and_store_kv: the norm's num_q_heads ({norm.num_q_heads}) must be qk's heads "
                         f"less value's ({heads} - {value.shape[1]})")
    if value.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotate_and_store_kv: value needs a contiguous head_dim and the caches must be contiguous")
    _launch(qk, cos, sin, norm, (value, k_cache, v_cache, slot_mapping))
