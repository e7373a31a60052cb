"""A family's config.json for a `ModelArch`, with the keys of the family's released checkpoints: what the random-
checkpoint writer (checkpoint.py) writes. The engine only reads config.json (each family's `parse_config`), so the
other direction lives here, off its import path.

DiffusionGemma is not here: ModelArch does not describe it, and diffusion_gemma_checkpoint.py writes its file.
"""
from __future__ import annotations

from diffulex_backend.arch import ModelArch

# The block sizes the released checkpoints ship with, written for a ModelArch that sets none.
SDAR_BLOCK_SIZE = 4  # SDAR-1.7B-Chat
DREAM_REASONER_BLOCK_SIZE = 32
FAST_DLLM_V2_BD_SIZE = 32


def config_json(model_name: str, arch: ModelArch) -> dict:
    """`model_name` is the family's registered name (AutoModelForDiffusionLM's key, not an alias)."""
    if model_name not in CONFIG_JSON:
        known = ", ".join(sorted(CONFIG_JSON))
        raise ValueError(f"no config.json writer for {model_name!r}; there is one for: {known}")
    return CONFIG_JSON[model_name](arch)


def llada(arch: ModelArch) -> dict:
    if arch.head_dim * arch.num_heads != arch.hidden_size:
        raise ValueError("llada: head_dim is d_model // n_heads; it cannot be set on its own")
    eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
    return {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": arch.hidden_size,
        "embedding_dropout": 0.0,
        "embedding_size": arch.vocab_size,
        "eos_token_id": eos,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": arch.mask_token_id,
        "max_sequence_length": arch.max_position_embeddings,
        "mlp_hidden_size": arch.intermediate_size,
        "mlp_ratio": max(1, arch.intermediate_size // arch.hidden_size),
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": arch.num_heads,
        "n_kv_heads": arch.num_kv_heads,
        "n_layers": arch.num_layers,
        "pad_token_id": eos,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": arch.rope_theta,
        "scale_logits": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": arch.vocab_size,
        "weight_tying": arch.tie_word_embeddings,
    }


def llada2(arch: ModelArch) -> dict:
    if arch.dense_layers != tuple(range(len(arch.dense_layers))):
        raise ValueError(f"llada2: only the first layers can be dense (first_k_dense_replace), got {arch.dense_layers}")
    eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "embedding_dropout": 0.0,
        "eos_token_id": eos,
        "first_k_dense_replace": len(arch.dense_layers),
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": arch.intermediate_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "max_window_layers": arch.num_layers,
        "model_type": "llada2_moe",
        "moe_intermediate_size": arch.moe_intermediate_size,
        "moe_router_enable_expert_bias": True,
        "moe_shared_expert_intermediate_size": arch.moe_intermediate_size * arch.num_shared_experts,
        "n_group": arch.num_expert_groups,
        "norm_head": False,
        "norm_softmax": False,
        "norm_topk_prob": True,
        "num_attention_heads": arch.num_heads,
        "num_experts": arch.num_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "num_hidden_layers": arch.num_layers,
        "num_key_value_heads": arch.num_kv_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": arch.num_shared_experts,
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": eos,
        "partial_rotary_factor": arch.partial_rotary_factor,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": arch.rope_theta,
        "rotary_dim": arch.rotary_dim,
        "routed_scaling_factor": arch.routed_scaling_factor,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": arch.tie_word_embeddings,
        "topk_group": arch.topk_groups,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": arch.qk_norm,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "use_sliding_window": False,
        "vocab_size": arch.vocab_size,
    }


def dream(arch: ModelArch) -> dict:
    if arch.head_dim * arch.num_heads != arch.hidden_size:
        raise ValueError("dream: head_dim is hidden_size // num_attention_heads; it cannot be set on its own")
    eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
    return {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": eos,
        "eos_token_id": eos,
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
        "transformers_version": "4.46.2",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": arch.vocab_size,
    }


def dream_reasoner(arch: ModelArch) -> dict:
    eos = arch.eos_token_ids[0] if arch.eos_token_ids else None
    return {
        "architectures": ["DreamForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModelForCausalLM": "modeling_dream.DreamForCausalLM",
        },
        "block_size": arch.block_size or DREAM_REASONER_BLOCK_SIZE,
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


def sdar(arch: ModelArch) -> dict:
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
        "block_size": arch.block_size or SDAR_BLOCK_SIZE,
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


def sdar_moe(arch: ModelArch) -> dict:
    return {
        **sdar(arch),
        "architectures": ["SDARMoeForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
            "AutoModel": "modeling_sdar_moe.SDARMoeModel",
            "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
        },
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(arch.dense_layers),
        "model_type": "sdar_moe",
        "moe_intermediate_size": arch.moe_intermediate_size,
        "norm_topk_prob": arch.norm_topk_prob,
        "num_experts": arch.num_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def fast_dllm_v2(arch: ModelArch) -> dict:
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
        "bd_size": arch.block_size or FAST_DLLM_V2_BD_SIZE,
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


def stable_diffcoder(arch: ModelArch) -> dict:
    # Seed-Coder's file has no head_dim (Llama then takes hidden_size // num_attention_heads); one is written
    # only for a shape that needs it.
    head_dim = {} if arch.head_dim * arch.num_heads == arch.hidden_size else {"head_dim": arch.head_dim}
    return {
        **head_dim,
        "architectures": ["StableDiffcoderForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.1,
        "auto_map": {"AutoModelForCausalLM": "modeling_stable_diffcoder.StableDiffcoderForCausalLM"},
        "bos_token_id": 0,
        "eos_token_id": arch.eos_token_ids[0] if arch.eos_token_ids else None,
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "initializer_range": 0.009882118,
        "intermediate_size": arch.intermediate_size,
        "layer_norm_eps": None,
        "max_position_embeddings": arch.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": arch.num_heads,
        "num_hidden_layers": arch.num_layers,
        "num_key_value_heads": arch.num_kv_heads,
        "resid_pdrop": 0.1,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": True,
        "vocab_size": arch.vocab_size,
    }


CONFIG_JSON = {
    "llada": llada,
    "llada2": llada2,
    "dream": dream,
    "diffucoder": dream,  # DiffuCoder ships Dream's file; its model_name tells it apart
    "dream_reasoner": dream_reasoner,
    "sdar": sdar,
    "sdar_moe": sdar_moe,
    "fast_dllm_v2": fast_dllm_v2,
    "stable_diffcoder": stable_diffcoder,
}
