"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, _1.5B): Qwen2.5-Instruct weights fine-tuned for block
diffusion.

The checkpoints keep Qwen2's layout and weight names (q/k/v bias); config.json adds `bd_size`, the block size
the model was trained with, and `layer_types` (every layer "full_attention"). Shifted, as the AR model it
started from: the logits at position i predict the token at position i + 1. The mask token is `|<MASK>|`, id
151665, which the released tokenizer adds to Qwen2.5's vocabulary; config.json does not name it, and the
reference generation code hard-codes it, so a config without `mask_token_id` whose vocabulary holds that id
takes it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from diffulex_backend.arch import ModelArch
from diffulex_backend.models.hf_config import ConfigReader
from diffulex_backend.models.qwen import QWEN_CONFIG_KEYS, QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM

RELEASED_MASK_TOKEN_ID = 151665  # |<MASK>| in the released tokenizers


@AutoModelForDiffusionLM.register("fast_dllm_v2")
class FastDLLMv2Model(QwenModel):
    FAMILY = "fast_dllm_v2"
    MODEL_TYPES = ("Fast_dLLM_Qwen",)
    ARCHITECTURES = ("Fast_dLLM_QwenForCausalLM",)
    CONFIG_KEYS = QWEN_CONFIG_KEYS | {"bd_size", "layer_types"}
    QKV_BIAS = True
    SHIFTED = True
    DEFAULT_BD_SIZE = 32  # what the released checkpoints ship with

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        arch = super().parse_config(config, path)
        c = ConfigReader(config, path, cls.FAMILY, cls.CONFIG_KEYS)
        layer_types = c.config.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != arch.num_layers
                                        or any(t != "full_attention" for t in layer_types)):
            raise ValueError(f"{path}: config key 'layer_types' must list 'full_attention' for each of the "
                             f"{arch.num_layers} layers (sliding-window layers are not supported), got {layer_types!r}")
        mask = arch.mask_token_id
        if mask is None and arch.vocab_size > RELEASED_MASK_TOKEN_ID:
            mask = RELEASED_MASK_TOKEN_ID
        return dataclasses.replace(arch, block_size=c.int("bd_size"), mask_token_id=mask)

    @classmethod
    def config_dict(cls, arch: ModelArch) -> dict:
        if arch.head_dim * arch.num_heads != arch.hidden_size:
            raise ValueError("fast_dllm_v2: head_dim is hidden_size // num_attention_heads; it cannot be set on its own")
        eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
        return {
            "architectures": ["Fast_dLLM_QwenForCausalLM"],
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                "AutoModel": "modeling.Fast_dLLM_QwenModel",
                "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
            },
            "bd_size": arch.block_size or cls.DEFAULT_BD_SIZE,
            "bos_token_id": eos,
            "eos_token_id": eos,
            "hidden_act": "silu",
            "hidden_size": arch.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": arch.intermediate_size,
            "layer_types": ["full_attention"] * arch.num_layers,
            "max_position_embeddings": arch.max_position_embeddings,
            "max_window_layers": arch.num_layers,
            "model_type": "Fast_dLLM_Qwen",
            "num_attention_heads": arch.num_heads,
            "num_hidden_layers": arch.num_layers,
            "num_key_value_heads": arch.num_kv_heads,
            "rms_norm_eps": arch.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": arch.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": arch.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.53.1",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": arch.vocab_size,
        }
