"""LLaDA2 (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini): a mixture-of-experts masked diffusion model.

Not shifted: position i predicts the token at position i (its training loss compares logits and labels at the
same position). The released generate() decodes blocks of 32 under a block-causal mask.

Per layer: fused `query_key_value`, an RMSNorm on each head's q and k, RoPE on the first half of each head's dims
(`partial_rotary_factor`), output `dense`. The first `first_k_dense_replace` layers have a dense SwiGLU MLP; the
others a MoE with a sigmoid router, a selection-only expert bias, group-limited top-k, renormalised weights
scaled by `routed_scaling_factor`, and a shared expert. The mask token is not in config.json: it comes from the
tokenizer (`<|mask|>`, 156895 in the released vocabulary).
"""
from __future__ import annotations

from pathlib import Path

from diffulex_backend.arch import ModelArch, RouterScore
from diffulex_backend.models.decoder_lm import DecoderLM, FusedPart
from diffulex_backend.models.hf_config import ConfigReader
from diffulex_backend.registry import AutoModelForDiffusionLM

# The keys of LLaDA2MoeConfig and of the released config.json.
LLADA2_CONFIG_KEYS = frozenset({
    "attention_dropout", "bos_token_id", "embedding_dropout", "eos_token_id", "first_k_dense_replace", "head_dim",
    "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "mask_token_id",
    "max_position_embeddings", "max_window_layers", "moe_intermediate_size", "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size", "mtp_loss_scaling_factor", "n_group", "norm_head", "norm_softmax",
    "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
    "num_key_value_heads", "num_nextn_predict_layers", "num_shared_experts", "output_dropout",
    "output_router_logits", "pad_token_id", "partial_rotary_factor", "rms_norm_eps", "rope_scaling", "rope_theta",
    "rotary_dim", "routed_scaling_factor", "router_dtype", "score_function", "sliding_window",
    "tie_word_embeddings", "topk_group", "use_bias", "use_qk_norm", "use_qkv_bias", "use_rmsnorm",
    "use_sliding_window", "using_split_qkv_in_self_attention", "vocab_size",
})


@AutoModelForDiffusionLM.register("llada2", aliases=("llada2_moe", "llada2_mini", "llada2dot1_mini"))
class LLaDA2Model(DecoderLM):
    MODEL_TYPES = ("llada2_moe",)
    ARCHITECTURES = ("LLaDA2MoeModelLM",)
    TOP_WEIGHTS = {
        "model.word_embeddings.weight": "embed_tokens.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    LAYER_PREFIX = "model.layers.{}."
    LAYER_WEIGHTS = {
        "input_layernorm.weight": ("attn_norm.weight", None),
        "attention.query_key_value.weight": ("attn.qkv_proj.weight", None),  # already fused: rows q, k, v
        "attention.query_layernorm.weight": ("attn.q_norm.weight", None),
        "attention.key_layernorm.weight": ("attn.k_norm.weight", None),
        "attention.dense.weight": ("attn.o_proj.weight", None),
        "post_attention_layernorm.weight": ("mlp_norm.weight", None),
        # the dense layers' MLP
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", FusedPart.GATE),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", FusedPart.UP),
        "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
        # the MoE layers' router and shared expert
        "mlp.gate.weight": ("mlp.gate.weight", None),
        "mlp.gate.expert_bias": ("mlp.expert_bias", None),
        "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", FusedPart.GATE),
        "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", FusedPart.UP),
        "mlp.shared_experts.down_proj.weight": ("mlp.shared_experts.down_proj.weight", None),
    }
    EXPERT_WEIGHTS = {
        "mlp.experts.{}.gate_proj.weight": ("mlp.w_gate_up", FusedPart.GATE),
        "mlp.experts.{}.up_proj.weight": ("mlp.w_gate_up", FusedPart.UP),
        "mlp.experts.{}.down_proj.weight": ("mlp.w_down", None),
    }
    # The routing of a tiny random checkpoint when the caller gives none: several groups, a shared expert and a
    # dense first layer, so that every rule of the released router takes part.
    RANDOM_ARCH = dict(qk_norm=True, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, num_shared_experts=1,
                      dense_layers=(0,), num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                      partial_rotary_factor=0.5)

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        c = ConfigReader(config, path, "llada2", LLADA2_CONFIG_KEYS)
        # Settings whose other values select code the released model does not run; LLaDA2MoeConfig's default
        # for use_bias is True (a bias on `dense`), so the released file spells it out.
        c.expect("hidden_act", ("silu",), default="silu")
        c.expect("use_qkv_bias", (False,), default=False)
        c.expect("use_bias", (False,), default=True)
        c.expect("norm_head", (False,), default=False)
        c.expect("rope_scaling", (None,), default=None)
        c.expect("use_sliding_window", (False,), default=False)
        c.expect("use_rmsnorm", (True,), default=True)
        c.expect("norm_softmax", (False,), default=False)
        c.expect("num_nextn_predict_layers", (0, None), default=0)
        c.expect("router_dtype", ("fp32", None), default="fp32")
        c.expect("score_function", ("sigmoid",), default="sigmoid")
        c.expect("moe_router_enable_expert_bias", (True,), default=True)
        # The released router always renormalises the kept weights (whenever more than one expert is kept).
        c.expect("norm_topk_prob", (True,), default=True)
        c.expect("using_split_qkv_in_self_attention", (False,), default=False)

        hidden_size, num_heads = c.int("hidden_size"), c.int("num_attention_heads")
        head_dim = c.int("head_dim", None, allow_none=True) or hidden_size // num_heads
        partial = c.float("partial_rotary_factor", 0.5)
        rotary_dim = c.int("rotary_dim", None, allow_none=True)
        if rotary_dim is not None and rotary_dim != int(head_dim * partial):
            raise ValueError(f"{path}: config key 'rotary_dim' ({rotary_dim}) differs from head_dim * "
                             f"partial_rotary_factor ({int(head_dim * partial)})")
        num_layers = c.int("num_hidden_layers")
        moe_inter, shared = c.int("moe_intermediate_size"), c.config.get("num_shared_experts") or 0
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"{path}: config key 'num_shared_experts' must be a count >= 0, got {shared!r}")
        shared_size = c.config.get("moe_shared_expert_intermediate_size")
        if shared_size is not None and shared_size != moe_inter * shared:
            raise ValueError(f"{path}: config key 'moe_shared_expert_intermediate_size' ({shared_size}) differs from"
                             f" moe_intermediate_size * num_shared_experts ({moe_inter * shared})")
        first_dense = c.config.get("first_k_dense_replace", 0)
        if isinstance(first_dense, bool) or not isinstance(first_dense, int) or not 0 <= first_dense <= num_layers:
            raise ValueError(f"{path}: config key 'first_k_dense_replace' must be in [0, {num_layers}],"
                             f" got {first_dense!r}")
        arch = dict(
            model_name="llada2",
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=c.int("num_key_value_heads"),
            head_dim=head_dim,
            intermediate_size=c.int("intermediate_size"),
            vocab_size=c.int("vocab_size"),
            rope_theta=c.float("rope_theta", 10000.0),
            rms_norm_eps=c.float("rms_norm_eps", 1e-5),
            max_position_embeddings=c.int("max_position_embeddings", 16384),
            tie_word_embeddings=c.bool("tie_word_embeddings", False),
            mask_token_id=c.token_id("mask_token_id"),
            eos_token_ids=c.token_ids("eos_token_id"),
            shifted=False,
            block_size=None,
            qk_norm=c.bool("use_qk_norm", True),
            partial_rotary_factor=partial,
            num_experts=c.int("num_experts"),
            num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=moe_inter,
            num_shared_experts=shared,
            dense_layers=tuple(range(first_dense)),
            num_expert_groups=c.int("n_group", 8),
            topk_groups=c.int("topk_group", 4),
            router_score=RouterScore.SIGMOID,
            router_bias=True,
            norm_topk_prob=True,
            routed_scaling_factor=c.float("routed_scaling_factor", 2.5),
            unrecognized_config_keys=c.unrecognized,
        )
        try:
            return ModelArch(**arch)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
