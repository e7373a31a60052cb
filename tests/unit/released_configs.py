"""The config.json of each served family's released checkpoints, key for key, as data.

Where a file's keys differ between releases of one family (a LLaDA2-mini file written by a newer transformers says
`dtype` where older ones say `torch_dtype`), each release has its own entry. Values are the released ones; a test that
loads a tiny checkpoint under one of these swaps in the tiny shape (`SHAPE_KEYS`) and keeps the key set.

Provenance: LLaDA-8B-Instruct, Dream-v0-Instruct-7B, SDAR-1.7B-Chat and Fast_dLLM_v2_7B are copied from their
published files. Stable-DiffCoder's file is Seed-Coder-8B-Base's published one (it keeps Seed-Coder's
architecture) with the StableDiffcoder class in `architectures` and `auto_map`. DiffuCoder's is Dream's key set
(DiffuCoder ships Dream's configuration code) with Qwen2.5-Coder-7B's shape. DreamReasoner-8B's is Qwen3-8B's key
set with Dream's `auto_map`, model type, mask and pad ids and the training `block_size`. LLaDA-1.5 and SDAR-4B-Chat
repeat their siblings' keys with their own shapes; LLaDA2.0/2.1-mini and SDAR-30B-A3B are the keys of their
configuration classes as the released files spell them.
"""
from __future__ import annotations

LLADA_8B_INSTRUCT = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 4096,
    "mlp_hidden_size": 12288, "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None,
    "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16",
    "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
    "rope_theta": 500000.0, "scale_logits": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.3",
    "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}
LLADA_1_5 = dict(LLADA_8B_INSTRUCT)

DREAM_V0_INSTRUCT_7B = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "mask_token_id": 151666,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "Dream", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "pad_token_id": 151643, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": False, "use_sliding_window": False,
    "vocab_size": 152064,
}
DIFFUCODER_7B_INSTRUCT = dict(DREAM_V0_INSTRUCT_7B)

SDAR_1_7B_CHAT = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
    "bos_token_id": 151643, "debug": False, "eos_token_id": 151643, "block_size": 4, "mask_token_id": 151669,
    "ep_size": 1, "fuse_cross_entropy": True, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 32768,
    "max_window_layers": 28, "micro_forward": False, "model_type": "sdar", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
SDAR_4B_CHAT = {**SDAR_1_7B_CHAT, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                "num_hidden_layers": 36, "max_window_layers": 36, "tie_word_embeddings": True}

SDAR_30B_A3B_CHAT = {
    **SDAR_1_7B_CHAT, "architectures": ["SDARMoeForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig", "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                 "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
    "model_type": "sdar_moe", "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 48,
    "max_window_layers": 48,
}

LLADA2_0_MINI = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "embedding_dropout": 0.0, "eos_token_id": 156892, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "max_position_embeddings": 32768, "max_window_layers": 20, "model_type": "llada2_moe",
    "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True, "moe_shared_expert_intermediate_size": 512,
    "n_group": 8, "norm_head": False, "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False,
    "pad_token_id": 156892, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 600000, "rotary_dim": 64, "routed_scaling_factor": 2.5, "router_dtype": "fp32",
    "score_function": "sigmoid", "tie_word_embeddings": False, "topk_group": 4, "torch_dtype": "bfloat16",
    "transformers_version": "4.52.3", "use_bias": False, "use_cache": False, "use_qk_norm": True,
    "use_qkv_bias": False, "use_rmsnorm": True, "use_sliding_window": False, "vocab_size": 157184,
}
LLADA2_1_MINI = {**{k: v for k, v in LLADA2_0_MINI.items() if k != "torch_dtype"}, "dtype": "bfloat16"}

FAST_DLLM_V2_7B = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "bd_size": 32, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "layer_types": ["full_attention"] * 28,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "Fast_dLLM_Qwen",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}

DREAM_REASONER_8B = {
    "architectures": ["DreamForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                 "AutoModelForCausalLM": "modeling_dream.DreamForCausalLM"},
    "block_size": 32, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288, "mask_token_id": 151669,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "Dream", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "pad_token_id": 151643, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.3", "use_cache": False, "use_sliding_window": False,
    "vocab_size": 151936,
}

STABLE_DIFFCODER_8B_INSTRUCT = {
    "architectures": ["StableDiffcoderForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "auto_map": {"AutoModelForCausalLM": "modeling_stable_diffcoder.StableDiffcoderForCausalLM"},
    "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.009882118, "intermediate_size": 14336, "layer_norm_eps": None,
    "max_position_embeddings": 32768, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "resid_pdrop": 0.1, "rms_norm_eps": 1e-06,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2", "use_cache": True, "vocab_size": 155136,
}

# (model_name, release) -> config.json. The model_name is the one to pass: detection cannot tell DiffuCoder or
# Dream-reasoner from Dream.
RELEASED = {
    ("llada", "LLaDA-8B-Instruct"): LLADA_8B_INSTRUCT,
    ("llada", "LLaDA-1.5"): LLADA_1_5,
    ("dream", "Dream-v0-Instruct-7B"): DREAM_V0_INSTRUCT_7B,
    ("sdar", "SDAR-1.7B-Chat"): SDAR_1_7B_CHAT,
    ("sdar", "SDAR-4B-Chat"): SDAR_4B_CHAT,
    ("llada2", "LLaDA2.0-mini"): LLADA2_0_MINI,
    ("llada2", "LLaDA2.1-mini"): LLADA2_1_MINI,
    ("sdar_moe", "SDAR-30B-A3B-Chat"): SDAR_30B_A3B_CHAT,
    ("fast_dllm_v2", "Fast_dLLM_v2_7B"): FAST_DLLM_V2_7B,
    ("diffucoder", "DiffuCoder-7B-Instruct"): DIFFUCODER_7B_INSTRUCT,
    ("dream_reasoner", "DreamReasoner-8B"): DREAM_REASONER_8B,
    ("stable_diffcoder", "Stable-DiffCoder-8B-Instruct"): STABLE_DIFFCODER_8B_INSTRUCT,
}

# Keys whose values fix tensor shapes or token ids: a tiny checkpoint's replace the released ones.
SHAPE_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "max_position_embeddings", "mask_token_id", "eos_token_id", "bos_token_id", "pad_token_id",
    "tie_word_embeddings", "max_window_layers", "layer_types", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "n_group", "topk_group", "first_k_dense_replace", "num_shared_experts",
    "moe_shared_expert_intermediate_size", "rotary_dim", "mlp_only_layers", "decoder_sparse_step",
    "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "mlp_ratio", "embedding_size",
    "max_sequence_length", "weight_tying", "block_size", "bd_size",
})


def with_tiny_shape(released: dict, tiny: dict) -> dict:
    """The released key set, with a tiny checkpoint's value for every key that fixes a shape or a token id (one the
    tiny file does not have keeps its released value)."""
    return {key: tiny[key] if key in SHAPE_KEYS and key in tiny else value for key, value in released.items()}
