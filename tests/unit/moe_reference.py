"""A float64 forward of the MoE families written from their formulas, reading config.json and the safetensors by
their released names: it shares no code with the engine's modules, routing or loader.

LLaDA2: fused query_key_value, per-head q/k RMSNorm, rotate-half RoPE on the first partial_rotary_factor of each
head, a dense SwiGLU in the first first_k_dense_replace layers, and elsewhere a MoE: sigmoid scores, an expert
bias added for selection only, groups scored by their two best biased scores, the best topk_group groups kept,
the top num_experts_per_tok experts among them, weights = unbiased scores renormalised and scaled by
routed_scaling_factor, plus a shared expert. SDAR-MoE (Qwen3-MoE): q/k/v apart, full RoPE, softmax scores over
all experts, top-k, renormalised when norm_topk_prob, no shared expert.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def read_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    directory = Path(path)
    config = json.loads((directory / "config.json").read_text())
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights = {}
    for file in files:
        weights.update({k: v.double() for k, v in load_file(directory / file).items()})
    return config, weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x [T, heads, D]: the first rotary_dim dims rotate (rotate-half), the rest pass."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated_half * sin, rest], -1)


def route(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, *, sigmoid: bool, groups: int,
          kept_groups: int, k: int, renormalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], weights [T, k]); equal scores go to the lower index."""
    logits = h @ router.T
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
    choice = scores if bias is None else scores + bias
    tokens, experts = choice.shape
    if groups > 1:
        per_group = choice.view(tokens, groups, experts // groups)
        group_score = per_group.sort(-1, descending=True).values[..., :2].sum(-1)
        best = torch.argsort(-group_score, dim=-1, stable=True)[:, :kept_groups]
        allowed = torch.zeros(tokens, groups, dtype=torch.bool)
        allowed[torch.arange(tokens)[:, None], best] = True
        choice = torch.where(allowed.repeat_interleave(experts // groups, 1), choice, torch.tensor(float("-inf")))
    ids = torch.argsort(-choice, dim=-1, stable=True)[:, :k]
    weights = scores.gather(1, ids)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * scale


class MoEReference:
    """`logits(tokens, mask)` over the whole sequence, as the exactness tests' reference samplers call it."""

    def __init__(self, path: str | Path, mask_token_id: int):
        self.config, self.w = read_checkpoint(path)
        self.llada2 = self.config["model_type"] == "llada2_moe"
        self.mask_token_id = mask_token_id

    def _attention(self, i: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c, w, n = self.config, self.w, x.shape[0]
        heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        if self.llada2:
            p = f"model.layers.{i}.attention."
            q, k, v = (x @ w[p + "query_key_value.weight"].T).split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
            q_norm, k_norm, out = w[p + "query_layernorm.weight"], w[p + "key_layernorm.weight"], w[p + "dense.weight"]
            rotary_dim = int(hd * c["partial_rotary_factor"])
        else:
            p = f"model.layers.{i}.self_attn."
            q, k, v = (x @ w[p + name + "_proj.weight"].T for name in "qkv")
            q_norm, k_norm, out = w[p + "q_norm.weight"], w[p + "k_norm.weight"], w[p + "o_proj.weight"]
            rotary_dim = hd
        eps, theta, positions = c["rms_norm_eps"], c["rope_theta"], torch.arange(n)
        q = rope(rms_norm(q.view(n, heads, hd), q_norm, eps), positions, rotary_dim, theta)
        k = rope(rms_norm(k.view(n, kv_heads, hd), k_norm, eps), positions, rotary_dim, theta)
        v = v.view(n, kv_heads, hd)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd) @ out.T

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.mlp."
        if self.llada2:
            dense = i < c["first_k_dense_replace"]
        else:
            dense = i in c["mlp_only_layers"] or (i + 1) % c["decoder_sparse_step"] != 0
        if dense:
            return swiglu(h, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        ids, weights = route(
            h, w[p + "gate.weight"], w.get(p + "gate.expert_bias"), sigmoid=self.llada2,
            groups=c.get("n_group", 1) if self.llada2 else 1, kept_groups=c.get("topk_group", 1) if self.llada2 else 1,
            k=c["num_experts_per_tok"], renormalise=c["norm_topk_prob"],
            scale=c["routed_scaling_factor"] if self.llada2 else 1.0)
        def stacked(name: str) -> torch.Tensor:  # [E, out, in]
            return torch.stack([w[f"{p}experts.{e}.{name}.weight"] for e in range(c["num_experts"])])

        gate, up, down = stacked("gate_proj")[ids], stacked("up_proj")[ids], stacked("down_proj")[ids]  # [T, k, ...]
        act = F.silu(torch.einsum("tkih,th->tki", gate, h)) * torch.einsum("tkih,th->tki", up, h)
        out = torch.einsum("tk,tkhi,tki->th", weights, down, act)
        if self.llada2 and c.get("num_shared_experts"):
            s = p + "shared_experts."
            out = out + swiglu(h, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
        return out

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c, w, eps = self.config, self.w, self.config["rms_norm_eps"]
        x = w["model.word_embeddings.weight" if self.llada2 else "model.embed_tokens.weight"][tokens]
        for i in range(c["num_hidden_layers"]):
            x = x + self._attention(i, rms_norm(x, w[f"model.layers.{i}.input_layernorm.weight"], eps), mask)
            x = x + self._mlp(i, rms_norm(x, w[f"model.layers.{i}.post_attention_layernorm.weight"], eps))
        logits = rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T
        logits[:, self.mask_token_id] = float("-inf")  # the engine never predicts the mask token
        return logits
