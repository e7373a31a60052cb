"""SDAR (JetLM/SDAR-1.7B/4B/8B-Chat): Qwen3 weights trained block-causally for block diffusion.

Not shifted: position i predicts the token at position i. config.json carries the training block_size.
"""
from __future__ import annotations

from diffulex_backend.arch import ModelArch
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
    DEFAULT_BLOCK_SIZE = 4  # what SDAR-1.7B-Chat ships with

    @classmethod
    def config_dict(cls, arch: ModelArch) -> dict:
        eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
        return {
            "architectures": ["SDARForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_sdar.SDARConfig",
                "AutoModel": "modeling_sdar.SDARModel",
                "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
            },
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_implementation": "flex_attention",
            "bos_token_id": eos,
            "debug": False,
            "eos_token_id": eos,
            "block_size": arch.block_size or cls.DEFAULT_BLOCK_SIZE,
            "mask_token_id": arch.mask_token_id,
            "ep_size": 1,
            "fuse_cross_entropy": True,
            "head_dim": arch.head_dim,
            "hidden_act": "silu",
            "hidden_size": arch.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": arch.intermediate_size,
            "max_position_embeddings": arch.max_position_embeddings,
            "max_window_layers": arch.num_layers,
            "micro_forward": False,
            "model_type": "sdar",
            "num_attention_heads": arch.num_heads,
            "num_hidden_layers": arch.num_layers,
            "num_key_value_heads": arch.num_kv_heads,
            "rms_norm_eps": arch.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": arch.rope_theta,
            "skip_checkpoint": False,
            "sliding_window": None,
            "tie_word_embeddings": arch.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.52.4",
            "use_cache": False,
            "use_deepep": False,
            "use_sliding_window": False,
            "vocab_size": arch.vocab_size,
        }
