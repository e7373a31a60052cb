"""Self-attention over the paged KV cache: fused q/k/v projection, optional per-head q/k norm, RoPE, then
the pluggable attention function (the torch reference on CPU, a Triton kernel on GPU).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.lora import LoraBatch, LoraStack, add_lora
from diffulex_backend.layers.norm import RMSNorm
from diffulex_backend.layers.rotary import apply_rotary
from diffulex_backend.arch import ModelArch
from diffulex_backend.tensor_parallel import TensorParallel

# (query [T,H,D], key [T,KVH,D], value [T,KVH,D], k_cache | None, v_cache | None, meta, scale) -> [T,H,D]
AttentionFn = Callable[..., torch.Tensor]


class SelfAttention(nn.Module):
    """Under tensor parallelism this rank's heads only (column-parallel q/k/v, row-parallel o_proj): the output
    is summed over ranks."""

    window: int | None = None  # every key of the context is seen (DiffusionGemma's sliding layers have one)

    def __init__(self, arch: ModelArch, attention_fn: AttentionFn, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        kv_heads = tp.kv_heads(arch)
        self.num_heads, self.num_kv_heads = arch.num_heads // tp.size, kv_heads.stop - kv_heads.start
        self.head_dim = arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.scale = arch.head_dim ** -0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.split_sizes), bias=arch.qkv_bias)  # rows: [q; k; v]
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attention_fn = attention_fn
        # The adapters' stacks (layers/lora.py), set when adapters are attached; None: no adapter targets them.
        self.qkv_lora: LoraStack | None = None
        self.o_lora: LoraStack | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim // 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor | None,  # [num_pages, page_size, kv_heads, head_dim]
        v_cache: torch.Tensor | None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        tokens = x.shape[0]
        q, k, v = add_lora(self.qkv_proj(x), x, self.qkv_lora, lora).split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_fn(q, k, v, k_cache, v_cache, meta, self.scale)
        if meta is not None and meta.retention_stats is not None:  # training passes no metadata
            meta.retention_stats.add(q, k_cache, meta, self.scale)
        out = out.reshape(tokens, -1)
        return self.tp.all_reduce(add_lora(self.o_proj(out), out, self.o_lora, lora))
