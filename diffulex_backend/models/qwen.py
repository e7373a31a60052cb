"""The Qwen2/Qwen3 decoder as Dream (Qwen2: q/k/v bias) and SDAR (Qwen3: per-head q/k norm) ship it:
Qwen config.json keys and Qwen weight names. One module, two switches. Llama's weight names and config keys are
the same as Qwen2's without the biases, so a Llama-layout family (Stable-DiffCoder) is this decoder with both
switches off."""
from __future__ import annotations

from pathlib import Path

from diffulex_backend.arch import ModelArch
from diffulex_backend.models.decoder_lm import DecoderLM, FusedPart
from diffulex_backend.models.hf_config import ConfigReader

# Keys the Qwen2 config.json family shares (Dream's config is exactly these plus mask_token_id).
QWEN_CONFIG_KEYS = frozenset({
    "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "mask_token_id", "max_position_embeddings", "max_window_layers",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps",
    "rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "use_sliding_window",
    "vocab_size",
})


class QwenModel(DecoderLM):
    # Set by each family.
    FAMILY = ""
    CONFIG_KEYS: frozenset[str] = QWEN_CONFIG_KEYS
    QKV_BIAS = False
    QK_NORM = False
    SHIFTED = False

    TOP_WEIGHTS = {
        "model.embed_tokens.weight": "embed_tokens.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    LAYER_PREFIX = "model.layers.{}."
    LAYER_WEIGHTS = {
        "input_layernorm.weight": ("attn_norm.weight", None),
        "self_attn.q_proj.weight": ("attn.qkv_proj.weight", FusedPart.Q),
        "self_attn.k_proj.weight": ("attn.qkv_proj.weight", FusedPart.K),
        "self_attn.v_proj.weight": ("attn.qkv_proj.weight", FusedPart.V),
        "self_attn.q_proj.bias": ("attn.qkv_proj.bias", FusedPart.Q),
        "self_attn.k_proj.bias": ("attn.qkv_proj.bias", FusedPart.K),
        "self_attn.v_proj.bias": ("attn.qkv_proj.bias", FusedPart.V),
        "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
        "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
        "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
        "post_attention_layernorm.weight": ("mlp_norm.weight", None),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", FusedPart.GATE),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", FusedPart.UP),
        "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    }

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        c = ConfigReader(config, path, cls.FAMILY, cls.CONFIG_KEYS)
        c.expect("hidden_act", ("silu",), default="silu")
        c.expect("use_sliding_window", (False,), default=False)
        if "attention_bias" in cls.CONFIG_KEYS:
            # Qwen3's attention_bias adds a bias to q, k, v and o; SDAR ships without it.
            c.expect("attention_bias", (False,), default=False)
        hidden_size, num_heads = c.int("hidden_size"), c.int("num_attention_heads")
        if "head_dim" in cls.CONFIG_KEYS and c.config.get("head_dim") is not None:
            head_dim = c.int("head_dim")
        elif hidden_size % num_heads:
            raise ValueError(
                f"{path}: config key 'hidden_size' ({hidden_size}) must be a multiple of"
                f" 'num_attention_heads' ({num_heads})"
            )
        else:
            head_dim = hidden_size // num_heads
        block_size = c.int("block_size", None, allow_none=True) if "block_size" in cls.CONFIG_KEYS else None
        num_layers = c.int("num_hidden_layers")
        fields = {**cls._dense_fields(c, hidden_size, num_heads, head_dim, num_layers, block_size),
                  **cls.moe_fields(c, num_layers)}
        try:
            return ModelArch(**fields)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def moe_fields(cls, c: ConfigReader, num_layers: int) -> dict:
        """The ModelArch fields of a MoE family's experts; none for a dense one."""
        return {}

    @classmethod
    def _dense_fields(cls, c: ConfigReader, hidden_size: int, num_heads: int, head_dim: int, num_layers: int,
                      block_size: int | None) -> dict:
        return dict(
            model_name=cls.FAMILY,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=c.int("num_key_value_heads", None, allow_none=True) or num_heads,
            head_dim=head_dim,
            intermediate_size=c.int("intermediate_size"),
            vocab_size=c.int("vocab_size"),
            rope_theta=c.rope_theta(),
            rms_norm_eps=c.float("rms_norm_eps"),
            max_position_embeddings=c.int("max_position_embeddings"),
            tie_word_embeddings=c.bool("tie_word_embeddings", False),
            mask_token_id=c.token_id("mask_token_id"),
            eos_token_ids=c.token_ids("eos_token_id"),
            shifted=cls.SHIFTED,
            block_size=block_size,
            qkv_bias=cls.QKV_BIAS,
            qk_norm=cls.QK_NORM,
            unrecognized_config_keys=c.unrecognized,
        )
