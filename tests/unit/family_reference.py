"""A float64 reference forward for the Qwen/Llama-layout families, written here from the formulas and read from
the checkpoint's own files by their released names; it shares no code with the engine's model.

`ReferenceModel.logits` has the interface of test_engine_exactness's `DenseModel`, so its plain samplers
(`reference_llada`, `reference_block_diffusion`) run on it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file


@dataclass(frozen=True)
class Layout:
    """What tells the families apart in the formulas."""

    qkv_bias: bool  # Qwen2 (Dream, DiffuCoder): q, k and v projections carry a bias
    qk_norm: bool  # Qwen3 (Dream-reasoner): RMSNorm over each head's q and k before RoPE
    shifted: bool  # Dream, DiffuCoder: the logits at position i predict the token at i + 1


LAYOUTS = {
    "diffucoder": Layout(qkv_bias=True, qk_norm=False, shifted=True),
    "dream_reasoner": Layout(qkv_bias=False, qk_norm=True, shifted=False),
    "stable_diffcoder": Layout(qkv_bias=False, qk_norm=False, shifted=False),
}


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):  # x [T, heads, d]: rotate the pairs (i, i + d/2)
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


class ReferenceModel:
    def __init__(self, directory: str | Path, family: str, mask_token_id: int):
        directory = Path(directory)
        self.cfg = json.loads((directory / "config.json").read_text())
        self.w = {k: v.to(torch.float64) for k, v in load_file(directory / "model.safetensors").items()}
        self.layout = LAYOUTS[family]
        self.mask_token_id = mask_token_id

    def forward(self, ids: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[T, vocab] logits at positions 0..T-1; visible[i, j]: position i attends to position j."""
        cfg, w, layout = self.cfg, self.w, self.layout
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eps, theta, n = cfg["rms_norm_eps"], cfg["rope_theta"], len(ids)
        positions = torch.arange(n)
        x = w["model.embed_tokens.weight"][ids]
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."

            def proj(name, h, bias=False):
                out = h @ w[f"{p}{name}.weight"].T
                return out + w[f"{p}{name}.bias"] if bias else out

            h = rms(x, w[f"{p}input_layernorm.weight"], eps)
            q = proj("self_attn.q_proj", h, layout.qkv_bias).view(n, heads, head_dim)
            k = proj("self_attn.k_proj", h, layout.qkv_bias).view(n, kv_heads, head_dim)
            v = proj("self_attn.v_proj", h, layout.qkv_bias).view(n, kv_heads, head_dim)
            if layout.qk_norm:
                q, k = rms(q, w[f"{p}self_attn.q_norm.weight"], eps), rms(k, w[f"{p}self_attn.k_norm.weight"], eps)
            q, k = rope(q, positions, theta), rope(k, positions, theta)
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            x = x + proj("self_attn.o_proj", torch.einsum("hts,shd->thd", probs, v).reshape(n, -1))
            h = rms(x, w[f"{p}post_attention_layernorm.weight"], eps)
            x = x + proj("mlp.down_proj", torch.nn.functional.silu(proj("mlp.gate_proj", h)) * proj("mlp.up_proj", h))
        head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
        return rms(x, w["model.norm.weight"], eps) @ head.T

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits that predict each position of `tokens`: a shifted model's come from the position before (the
        first position keeps its own), and the mask token is never predicted."""
        logits = self.forward(tokens, mask)
        if self.layout.shifted:
            logits = torch.cat([logits[:1], logits[:-1]])
        logits[:, self.mask_token_id] = float("-inf")
        return logits
