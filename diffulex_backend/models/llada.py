"""LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5): an OLMo-style config.json and "llama" blocks.

Full attention, not shifted: position i predicts the token at position i.
"""
from __future__ import annotations

from pathlib import Path

from diffulex_backend.arch import ModelArch
from diffulex_backend.models.decoder_lm import DecoderLM, FusedPart
from diffulex_backend.models.hf_config import ConfigReader
from diffulex_backend.registry import AutoModelForDiffusionLM

# Every key of the released config.json and of the LLaDA ModelConfig that writes it.
LLADA_CONFIG_KEYS = frozenset({
    "activation_type", "alibi", "alibi_bias_max", "attention_dropout", "attention_layer_norm",
    "attention_layer_norm_with_affine", "bias_for_layer_norm", "block_group_size", "block_type", "d_model",
    "embedding_dropout", "embedding_size", "eos_token_id", "flash_attention", "flash_attn_varlen",
    "include_bias", "include_qkv_bias", "init_cutoff_factor", "init_device", "init_fn", "init_std",
    "input_emb_norm", "layer_norm_type", "layer_norm_with_affine", "mask_token_id", "max_sequence_length",
    "mlp_hidden_size", "mlp_ratio", "multi_query_attention", "n_heads", "n_kv_heads", "n_layers",
    "pad_token_id", "precision", "residual_dropout", "rms_norm_eps", "rope", "rope_full_precision",
    "rope_theta", "scale_logits", "vocab_size", "weight_tying",
})


@AutoModelForDiffusionLM.register("llada")
class LLaDAModel(DecoderLM):
    MODEL_TYPES = ("llada",)
    ARCHITECTURES = ("LLaDAModelLM",)
    TOP_WEIGHTS = {
        "model.transformer.wte.weight": "embed_tokens.weight",
        "model.transformer.ln_f.weight": "norm.weight",
        "model.transformer.ff_out.weight": "lm_head.weight",
    }
    LAYER_PREFIX = "model.transformer.blocks.{}."
    LAYER_WEIGHTS = {
        "attn_norm.weight": ("attn_norm.weight", None),
        "q_proj.weight": ("attn.qkv_proj.weight", FusedPart.Q),
        "k_proj.weight": ("attn.qkv_proj.weight", FusedPart.K),
        "v_proj.weight": ("attn.qkv_proj.weight", FusedPart.V),
        "attn_out.weight": ("attn.o_proj.weight", None),
        "ff_norm.weight": ("mlp_norm.weight", None),
        "ff_proj.weight": ("mlp.gate_up_proj.weight", FusedPart.GATE),
        "up_proj.weight": ("mlp.gate_up_proj.weight", FusedPart.UP),
        "ff_out.weight": ("mlp.down_proj.weight", None),
    }

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        c = ConfigReader(config, path, "llada", LLADA_CONFIG_KEYS)
        # Settings that select another architecture than the released one; absent keys take the
        # ModelConfig default, which for block_type/rope/layer_norm_type/activation_type is not LLaDA's,
        # so those four must be spelled out.
        c.expect("block_type", ("llama",))
        c.expect("rope", (True,))
        c.expect("layer_norm_type", ("rms",))
        c.expect("activation_type", ("silu",))
        c.expect("alibi", (False,), default=False)
        c.expect("attention_layer_norm", (False,), default=False)
        c.expect("input_emb_norm", (False,), default=False)
        c.expect("scale_logits", (False,), default=False)
        c.expect("include_bias", (False,), default=False)
        c.expect("include_qkv_bias", (False, None), default=False)
        c.expect("bias_for_layer_norm", (False, None), default=None)
        c.expect("layer_norm_with_affine", (True,), default=True)
        c.expect("block_group_size", (1,), default=1)
        c.expect("multi_query_attention", (None, False), default=None)

        d_model, n_heads = c.int("d_model"), c.int("n_heads")
        if d_model % n_heads:
            raise ValueError(f"{path}: config key 'd_model' ({d_model}) must be a multiple of 'n_heads' ({n_heads})")
        vocab_size = c.int("vocab_size")
        embedding_size = c.int("embedding_size", None, allow_none=True)
        if embedding_size not in (None, vocab_size):
            raise ValueError(
                f"{path}: config key 'embedding_size' ({embedding_size}) differs from 'vocab_size' ({vocab_size});"
                " a padded embedding table is not supported"
            )
        mlp_hidden_size = c.int("mlp_hidden_size", None, allow_none=True)
        if mlp_hidden_size is None:
            mlp_hidden_size = c.int("mlp_ratio", 4) * d_model
        return ModelArch(
            model_name="llada",
            hidden_size=d_model,
            num_layers=c.int("n_layers"),
            num_heads=n_heads,
            num_kv_heads=c.int("n_kv_heads", None, allow_none=True) or n_heads,
            head_dim=d_model // n_heads,
            intermediate_size=mlp_hidden_size,
            vocab_size=vocab_size,
            rope_theta=c.float("rope_theta"),
            rms_norm_eps=c.float("rms_norm_eps", 1e-5),
            max_position_embeddings=c.int("max_sequence_length"),
            tie_word_embeddings=c.bool("weight_tying"),
            mask_token_id=c.token_id("mask_token_id"),
            eos_token_ids=c.token_ids("eos_token_id"),
            shifted=False,
            block_size=None,
            unrecognized_config_keys=c.unrecognized,
        )
