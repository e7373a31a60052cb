"""A plain PyTorch implementation over the engine model's weights: what a user's hand-written decode loop does.

Hugging Face style: separate q/k/v and gate/up projections, RMSNorm and rotary as plain tensor ops, the cached
K/V of the prefix held contiguously per request and concatenated with the block's K/V (as a growing cache
does), `scaled_dot_product_attention`, logits for every fed position. The block sees its whole prefix and
itself, so attention needs no mask. To keep the largest cases in memory, every layer reads the same cached
K/V tensors: the bytes each layer moves are a real layer's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PlainDecoder:
    def __init__(self, model):
        self.model = model
        arch = model.arch
        self.arch = arch
        self.group = arch.num_heads // arch.num_kv_heads
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
        self.inv_freq = inv_freq.to(model.embed_tokens.weight.device)

    def _rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L]
        positions: torch.Tensor,  # [L]: every request's block sits at the same positions here
        past_k: torch.Tensor,  # [B, kv_heads, C, head_dim]
        past_v: torch.Tensor,
    ) -> torch.Tensor:  # [B, L, vocab]
        arch, model = self.arch, self.model
        batch, length = input_ids.shape
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q_size, kv_size = arch.q_size, arch.kv_size
        for layer in model.layers:
            attn, mlp = layer.attn, layer.mlp
            h = self._rms_norm(x, layer.attn_norm)
            weight, bias = attn.qkv_proj.weight, attn.qkv_proj.bias
            q = F.linear(h, weight[:q_size], None if bias is None else bias[:q_size])
            k = F.linear(h, weight[q_size:q_size + kv_size], None if bias is None else bias[q_size:q_size + kv_size])
            v = F.linear(h, weight[q_size + kv_size:], None if bias is None else bias[q_size + kv_size:])
            q = q.view(batch, length, arch.num_heads, arch.head_dim).transpose(1, 2)
            k = k.view(batch, length, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
            v = v.view(batch, length, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
            if self.group > 1:
                k = k.repeat_interleave(self.group, dim=1)
                v = v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(batch, length, q_size), attn.o_proj.weight)
            h = self._rms_norm(x, layer.mlp_norm)
            size = mlp.intermediate_size
            gate_up = mlp.gate_up_proj.weight
            x = x + F.linear(F.silu(F.linear(h, gate_up[:size])) * F.linear(h, gate_up[size:]), mlp.down_proj.weight)
        return model.compute_logits(self._rms_norm(x, model.norm))

    def decode_step(self, block: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                    mask_token_id: int, tokens_per_step: int) -> torch.Tensor:
        """One step of a hand-written block-diffusion loop: forward, softmax confidence, unmask the
        `tokens_per_step` most confident masked positions of each block. block: [B, L] -> the new block."""
        logits = self.forward(block, positions, past_k, past_v)
        probs = torch.softmax(logits.float(), dim=-1)
        confidence, predicted = probs.max(dim=-1)
        masked = block == mask_token_id
        confidence = torch.where(masked, confidence, torch.full_like(confidence, -1.0))
        chosen = confidence.topk(tokens_per_step, dim=-1).indices
        accept = torch.zeros_like(masked).scatter_(1, chosen, True) & masked
        return torch.where(accept, predicted, block)
