"""One pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h)). LLaDA's llama block, the
Qwen2/Qwen3 decoder layer and LLaDA2's and Qwen3-MoE's layers are this block under different weight names; the
MLP is the dense gated one or, in a MoE model's MoE layers, the mixture of experts."""
from __future__ import annotations

import torch
from torch import nn

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.lora import LoraBatch
from diffulex_backend.layers.mlp import GatedMLP
from diffulex_backend.layers.moe import MoE
from diffulex_backend.layers.norm import RMSNorm
from diffulex_backend.layers.self_attention import AttentionFn, SelfAttention
from diffulex_backend.arch import ModelArch
from diffulex_backend.tensor_parallel import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, attention_fn: AttentionFn, layer: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = SelfAttention(arch, attention_fn, tp)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MoE(arch, tp) if arch.is_moe_layer(layer) else GatedMLP(arch.hidden_size, arch.intermediate_size, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, meta, k_cache, v_cache, lora)
        if lora is None or isinstance(self.mlp, MoE):  # adapters reach dense MLPs only
            return h + self.mlp(self.mlp_norm(h))
        return h + self.mlp(self.mlp_norm(h), lora)
