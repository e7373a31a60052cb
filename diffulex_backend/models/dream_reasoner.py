"""Dream-reasoner (DreamLM/DreamReasoner-8B): Dream's layout and config keys on a Qwen3 decoder.

Per layer: q/k/v/o without bias and an RMSNorm on each head's q and k before RoPE (Qwen3); config.json carries
`head_dim`, `attention_bias` and the training `block_size` beside Dream's keys. Not shifted: position i predicts
the token at position i. Its config.json says model_type "Dream", so `model_name` "dream_reasoner" picks this
family (detection would take Dream, whose weights have no q/k norm and do have q/k/v biases).
"""
from __future__ import annotations

from diffulex_backend.arch import ModelArch
from diffulex_backend.models.qwen import QWEN_CONFIG_KEYS, QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("dream_reasoner")
class DreamReasonerModel(QwenModel):
    FAMILY = "dream_reasoner"
    MODEL_TYPES = ()  # "Dream" is the dream family's
    ARCHITECTURES = ()
    CONFIG_KEYS = QWEN_CONFIG_KEYS | {"attention_bias", "block_size", "head_dim"}
    QK_NORM = True
    DEFAULT_BLOCK_SIZE = 32

    @classmethod
    def config_dict(cls, arch: ModelArch) -> dict:
        eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
        return {
            "architectures": ["DreamForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_dream.DreamConfig",
                "AutoModelForCausalLM": "modeling_dream.DreamForCausalLM",
            },
            "block_size": arch.block_size or cls.DEFAULT_BLOCK_SIZE,
            "bos_token_id": eos,
            "eos_token_id": eos,
            "head_dim": arch.head_dim,
            "hidden_act": "silu",
            "hidden_size": arch.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": arch.intermediate_size,
            "mask_token_id": arch.mask_token_id,
            "max_position_embeddings": arch.max_position_embeddings,
            "max_window_layers": arch.num_layers,
            "model_type": "Dream",
            "num_attention_heads": arch.num_heads,
            "num_hidden_layers": arch.num_layers,
            "num_key_value_heads": arch.num_kv_heads,
            "pad_token_id": eos,
            "rms_norm_eps": arch.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": arch.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": arch.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.3",
            "use_cache": False,
            "use_sliding_window": False,
            "vocab_size": arch.vocab_size,
        }
