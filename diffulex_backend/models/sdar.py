"""SDAR (JetLM/SDAR-1.7B/4B/8B-Chat): Qwen3 weights trained block-causally for block diffusion.

Not shifted: position i predicts the token at position i. config.json carries the training block_size.
"""
from __future__ import annotations

from diffulex_backend.models.qwen import QWEN_CONFIG_KEYS, QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("sdar")
class SDARModel(QwenModel):
    FAMILY = "sdar"
    MODEL_TYPES = ("sdar",)
    ARCHITECTURES = ("SDARForCausalLM",)
    CONFIG_KEYS = QWEN_CONFIG_KEYS | {
        "attention_bias", "attn_implementation", "block_size", "debug", "ep_size", "fuse_cross_entropy",
        "head_dim", "micro_forward", "skip_checkpoint", "use_deepep",
    }
    QK_NORM = True
