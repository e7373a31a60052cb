"""attention_backend "flash_attn": flash-attn's Hopper kernel for prompts, the Triton kernel for blocks.

A prompt's first forward is a dense varlen attention with no cached context (`AttentionMetadata.dense`), bound
by the tensor cores; so is every step of vanilla, which feeds the whole sequence. There flash-attn's CuTe-DSL
kernel (the flash-attn-4 package, imported as `flash_attn.cute`) runs within 1.2x of the compute floor and the
Triton kernel at about 2.5x (benchmarks/attention.py; docs/kernels.md has the table, measured on Hopper). A block
over a cached context is bound by reading the cache, where the two are alike and the Triton kernel needs no host
work per call, so it takes every other forward and every CUDA graph. Each forward goes wholly to one kernel, and
the in-forward K/V are stored to the cache alike. A prompt's first forward that carries its first block too
(multi_bd, d2f) is two dense attentions: the prompt among itself, then the block over prompt and block.

flash-attn computes in bfloat16 and float16 only, with head sizes 64 and 128 here (those the Triton kernel takes
too), and no sliding window.
"""
from __future__ import annotations

import os

import torch

from .attention import AttentionMetadata, HeadMask

PACKAGE = "flash-attn-4"
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)


def import_flash_attn():
    """(flash-attn's varlen entry point, None), or (None, why it cannot be imported): the package is absent, or a
    `flash_attn` package fails on import (a flash-attn 2 built for another torch, say), and then the model is served
    without it rather than not at all."""
    # flash-attn compiles its kernels when first called. Its disk cache, off unless asked for, lets every later
    # engine (a reloaded model, the next server) load them instead: on here, unless the environment says otherwise.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as error:  # whatever the import raises, the package cannot serve
        return None, f"{type(error).__name__}: {error}"
    return flash_attn_varlen_func, None


def flash_attn_installed() -> bool:
    return import_flash_attn()[1] is None


def refusal(capability: tuple[int, int] | None, dtype: torch.dtype, head_dims: tuple[int, ...],
            windowed: bool) -> str | None:
    """Why flash_attn cannot serve this model on a device of compute `capability` (None: not a GPU), or None when
    it can. The package is imported last, only where everything else allows it."""
    if capability is None:
        return "which needs a CUDA device; use 'torch' on CPU"
    major, minor = capability
    if major < 9:
        return f"whose kernels need compute capability 9.0 or newer; this GPU has {major}.{minor}"
    if dtype not in DTYPES:
        return f"which computes in bfloat16 or float16; this engine's dtype is {str(dtype).removeprefix('torch.')}"
    if not set(head_dims) <= set(HEAD_DIMS):
        shown = head_dims[0] if len(head_dims) == 1 else head_dims
        return f"taken here at head_dim {HEAD_DIMS}; this model's is {shown}"
    if windowed:
        return "which takes no sliding window here; this model has windowed layers"
    _, error = import_flash_attn()
    if error is not None:
        return (f"whose package {PACKAGE} (flash_attn.cute) cannot be imported ({error}); see README, "
                "'Attention backends'")
    return None


class PromptFlashAttention:
    """The attention function of attention_backend "flash_attn": a dense varlen kernel for a forward the host found
    dense (`AttentionMetadata.dense`), the Triton kernel (`blocks`) for the rest. Called as the kernel is.

    `varlen` is flash-attn's `flash_attn_varlen_func` (the default) or a function of its signature: (q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal), where a causal mask aligns a
    sequence's last query with its last key; `store_kv` writes the in-forward K/V to the cache (the kernel's by
    default)."""

    def __init__(self, blocks, varlen=None, store_kv=None):
        if store_kv is None:
            from diffulex_kernels.attention import store_kv
        if varlen is None:
            varlen, error = import_flash_attn()
            if error is not None:
                raise ValueError(f"flash-attn cannot be imported: {error}")
        self.blocks = blocks
        self.varlen = varlen
        self.store_kv = store_kv

    def _varlen(self, query, key, value, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
        out = self.varlen(query, key, value, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                         max_seqlen_k=max_k, softmax_scale=scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor | None,
                 v_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float, *,
                 kv_stored: bool = False) -> torch.Tensor:
        dense = meta.dense
        if dense is None:  # as in every CUDA graph
            return self.blocks(query, key, value, k_cache, v_cache, meta, scale, kv_stored=kv_stored)
        if k_cache is not None and not kv_stored:
            self.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        causal = dense.head_mask is HeadMask.CAUSAL
        if dense.tail_rows is None:  # every row is a head row
            return self._varlen(query, key, value, dense.cu_head, dense.cu_head, dense.max_head, dense.max_head,
                               scale, causal)
        # The heads among themselves, then each tail over its whole sequence.
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        rows = dense.head_rows
        out[rows] = self._varlen(query[rows], key[rows], value[rows], dense.cu_head, dense.cu_head, dense.max_head,
                                dense.max_head, scale, causal)
        rows = dense.tail_rows
        out[rows] = self._varlen(query[rows], key, value, dense.cu_tail, meta.cu_seqlens_q, dense.max_tail,
                                meta.max_seqlen_q, scale, False)
        return out

    def compile(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> None:
        """Compile the dense kernels of one layer layout, full and causal, before the first prompt waits on it."""
        length = 128  # two prompts of a typical length: the variants a prompt takes, not a degenerate one's
        query = torch.zeros((2 * length, num_heads, head_dim), dtype=dtype, device=device)
        key = torch.zeros((2 * length, num_kv_heads, head_dim), dtype=dtype, device=device)
        cu = torch.tensor([0, length, 2 * length], dtype=torch.int32, device=device)
        for causal in (False, True):
            self.varlen(query, key, key, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length,
                       softmax_scale=1.0, causal=causal)
