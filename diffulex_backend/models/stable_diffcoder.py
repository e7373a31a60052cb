"""Stable-DiffCoder (ByteDance-Seed/Stable-DiffCoder-8B-Base, -Instruct): Seed-Coder's Llama weights trained with
block diffusion.

The checkpoint is a plain Llama: model_type "llama", Llama's config keys and weight names, no biases (its
config.json spells out `attention_bias` and `mlp_bias` false). What names the family is "StableDiffcoder" in
`architectures` or in an `auto_map` class path. Not shifted: position i predicts the token at position i. The
mask token is not in config.json: it comes from the tokenizer (`<[MASK_TOKEN]>`).
"""
from __future__ import annotations

from pathlib import Path

from diffulex_backend.arch import ModelArch
from diffulex_backend.models.hf_config import ConfigReader
from diffulex_backend.models.qwen import QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM

# Llama's config.json keys, and those Seed-Coder's carries beside them.
LLAMA_CONFIG_KEYS = frozenset({
    "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act", "hidden_size",
    "initializer_range", "intermediate_size", "mask_token_id", "max_position_embeddings", "mlp_bias",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps",
    "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size",
    # Llama: pretraining_tp > 1 cuts each projection into slices whose results are summed: the same math.
    "pretraining_tp",
    # Seed-Coder: a dropout (training only) and an unused LayerNorm epsilon (null; the norms are RMSNorms).
    "layer_norm_eps", "resid_pdrop",
})
MARK = "StableDiffcoder"  # in the class names of `architectures` and `auto_map`


@AutoModelForDiffusionLM.register("stable_diffcoder")
class StableDiffCoderModel(QwenModel):
    FAMILY = "stable_diffcoder"
    MODEL_TYPES = ()  # "llama" names any Llama; `recognises` looks for the family's class name instead
    ARCHITECTURES = ("StableDiffcoderForCausalLM",)
    CONFIG_KEYS = LLAMA_CONFIG_KEYS

    @classmethod
    def recognises(cls, config: dict) -> bool:
        auto_map = config.get("auto_map")
        paths = [v for v in auto_map.values() if isinstance(v, str)] if isinstance(auto_map, dict) else []
        return any(MARK in name for name in [*(config.get("architectures") or []), *paths] if isinstance(name, str))

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        # Llama's mlp_bias adds a bias to gate, up and down, which this decoder does not have.
        ConfigReader(config, path, cls.FAMILY, cls.CONFIG_KEYS).expect("mlp_bias", (False,), default=False)
        return super().parse_config(config, path)
