"""attention_backend "flash_attn": flash-attn's Hopper kernels for prompts, and for the cached context of wide GQA
groups; the Triton kernel for the rest.

A prompt's first forward is a dense varlen attention with no cached context (`AttentionMetadata.dense`), bound
by the tensor cores; so is every step of vanilla, which feeds the whole sequence. There flash-attn's CuTe-DSL
kernel (the flash-attn-4 package, imported as `flash_attn.cute`) runs within 1.2x of the compute floor and the
Triton kernel at about 2.5x (benchmarks/attention.py; docs/kernels.md has the table, measured on Hopper). A prompt's
first forward that carries its first block too (multi_bd, d2f) is two dense attentions: the prompt among itself,
then the block over prompt and block.

A forward over a cached context is bound by reading the cache. Where a kv head serves MIN_CONTEXT_GROUP query heads
or more (Dream-7B's 7), flash-attn's paged kernel reads it faster than the Triton kernel, and takes the context:
each row's attention over its sequence's cached tokens, as an output and a log-sum-exp, from which the Triton
kernel goes on over the in-forward keys under the block mask (`paged_attention(prior=...)`). Blocks in flight are
not in the cache, so no one call of flash-attn could see them. Both kernels read only device metadata and take host
bounds alike, so this runs inside the CUDA graphs too. Narrower groups, and caches of FP8 rows, which flash-attn
does not read, take the Triton kernel whole. Every forward stores the in-forward K/V to the cache alike.

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
# The narrowest GQA group (query heads a kv head) whose cached context goes to flash-attn's paged kernel.
MIN_CONTEXT_GROUP = 4


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


class FlashAttention:
    """The attention function of attention_backend "flash_attn": a dense varlen kernel for a forward the host found
    dense (`AttentionMetadata.dense`), the paged one for the cached context of a group of `min_context_group` query
    heads a kv head or more, and the Triton kernel (`blocks`) for the rest. Called as the kernel is.

    `varlen` is flash-attn's `flash_attn_varlen_func` (the default) or a function of its signature, called in two
    ways: dense, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal), where a
    causal mask aligns a sequence's last query with its last key; and paged, (q, k_cache, v_cache, cu_seqlens_q,
    seqused_k, max_seqlen_q, max_seqlen_k, page_table, softmax_scale, causal=False, return_lse=True), returning
    (out, lse) as `attention.context_attention_reference` computes them. `blocks` takes `prior=`, and `fp8_out=`
    where the caller asks for them, as `paged_attention` does. `store_kv` writes the in-forward K/V to the cache
    (the kernel's by default)."""

    def __init__(self, blocks, varlen=None, store_kv=None, min_context_group: int = MIN_CONTEXT_GROUP):
        if store_kv is None:
            from diffulex_kernels.attention import store_kv
        if varlen is None:
            varlen, error = import_flash_attn()
            if error is not None:
                raise ValueError(f"flash-attn cannot be imported: {error}")
        self.blocks = blocks
        self.varlen = varlen
        self.store_kv = store_kv
        self.min_context_group = min_context_group

    def _varlen(self, query, key, value, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
        out = self.varlen(query, key, value, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                         max_seqlen_k=max_k, softmax_scale=scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor | None,
                 v_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float, *,
                 kv_stored: bool = False, fp8_out: bool = False):
        """The attention's output [T, heads, head_dim]; with `fp8_out`, as the Triton kernel gives it then: each
        token's heads as one row cast to fp8 with a scale, for an fp8 o_proj."""
        dense = meta.dense  # None in every CUDA graph
        cast = {"fp8_out": True} if fp8_out else {}  # asked of `blocks` only where wanted
        if dense is None and not self.takes_context(query, key, k_cache, meta):
            return self.blocks(query, key, value, k_cache, v_cache, meta, scale, kv_stored=kv_stored, **cast)
        if k_cache is not None and not kv_stored:
            self.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        if dense is None:  # flash-attn's context, then the blocks kernel over the in-forward keys
            prior = self.varlen(query, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.context_lens,
                                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_context_len,
                                page_table=meta.page_tables, softmax_scale=scale, causal=False, return_lse=True)
            return self.blocks(query, key, value, None, None, meta, scale, prior=prior, **cast)
        out = self._dense(query, key, value, dense, meta, scale)
        if not fp8_out:
            return out
        from diffulex_kernels.fp8 import quantize_rows

        return quantize_rows(out.reshape(out.shape[0], -1))

    def _dense(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dense, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """A forward the host found dense, in flash-attn's varlen kernel."""
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

    def takes_context(self, query: torch.Tensor, key: torch.Tensor, k_cache: torch.Tensor | None,
                      meta: AttentionMetadata) -> bool:
        """Whether flash-attn's paged kernel takes this forward's cached context: a wide enough group over a cache
        of the model's dtype (FP8 rows are the Triton kernel's) that may hold a context."""
        return (k_cache is not None and meta.max_context_len > 0
                and self.takes_context_of(query.shape[1], key.shape[1], k_cache.dtype, query.dtype))

    def takes_context_of(self, num_heads: int, num_kv_heads: int, cache_dtype: torch.dtype,
                         dtype: torch.dtype) -> bool:
        """Whether a layer of this layout, over a cache of `cache_dtype`, gives its context to the paged kernel."""
        return cache_dtype == dtype and num_heads // num_kv_heads >= self.min_context_group

    def compile(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                page_size: int, cache_dtype: torch.dtype) -> None:
        """Compile the dense kernels of one layer layout, full and causal, and the paged one where it takes the
        context, before the first request waits on them."""
        length = 128  # two prompts of a typical length: the variants a prompt takes, not a degenerate one's
        query = torch.zeros((2 * length, num_heads, head_dim), dtype=dtype, device=device)
        key = torch.zeros((2 * length, num_kv_heads, head_dim), dtype=dtype, device=device)
        cu = torch.tensor([0, length, 2 * length], dtype=torch.int32, device=device)
        for causal in (False, True):
            self.varlen(query, key, key, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length,
                       softmax_scale=1.0, causal=causal)
        if self.takes_context_of(num_heads, num_kv_heads, cache_dtype, dtype):  # a block over two cached pages
            cache = torch.zeros((2, page_size, num_kv_heads, head_dim), dtype=dtype, device=device)
            int32 = dict(dtype=torch.int32, device=device)
            self.varlen(query[:32], cache, cache, cu_seqlens_q=torch.tensor([0, 32], **int32),
                        seqused_k=torch.tensor([2 * page_size], **int32), max_seqlen_q=32, max_seqlen_k=2 * page_size,
                        page_table=torch.tensor([[0, 1]], **int32), softmax_scale=1.0, causal=False, return_lse=True)
