"""Write the K/V of tokens into the paged cache at their slots (the kernel twin of `attention.store_kv`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_for_previous_kernel


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_slot, stride_cache_head,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < KV_HEADS)[:, None]
    # [BLOCK_H, HEAD_DIM]: one token's K (then V) for every kv head.
    src_k = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = slot.to(tl.int64) * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 to skip a token
) -> None:
    """Copy each token's K/V into cache slot `slot_mapping[t]` (flat over pages); tokens at -1 are skipped. The
    caches may be column views of wider rows, as long as a slot's heads are contiguous."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("store_kv: key and value need a contiguous head_dim")
    # A slot is flat over pages; a cache may be a column view of wider rows (DiffusionGemma's per-layer caches).
    if not all(cache.stride() == k_cache.stride() and cache.stride(-1) == 1 and cache.stride(2) == head_dim
               and cache.stride(0) == cache.shape[1] * cache.stride(1) for cache in (k_cache, v_cache)):
        raise ValueError("store_kv: k_cache and v_cache need the same strides, contiguous heads and slots "
                         "evenly strided across pages")
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads), USE_PDL=use_pdl(key),
        num_warps=4, launch_pdl=use_pdl(key),
    )
