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
