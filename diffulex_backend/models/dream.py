"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): Qwen2.5 weights trained as a masked diffusion model.

Shifted: the logits at position i predict the token at position i + 1, as in the AR model it started from.
"""
from __future__ import annotations

from diffulex_backend.arch import ModelArch
from diffulex_backend.models.qwen import QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("dream")
class DreamModel(QwenModel):
    FAMILY = "dream"
    MODEL_TYPES = ("Dream", "dream")
    ARCHITECTURES = ("DreamModel",)
    QKV_BIAS = True
    SHIFTED = True

    @classmethod
    def config_dict(cls, arch: ModelArch) -> dict:
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


@AutoModelForDiffusionLM.register("diffucoder")
class DiffuCoderModel(DreamModel):
    """DiffuCoder (apple/DiffuCoder-7B-Base, -Instruct, -cpGRPO): Qwen2.5-Coder weights trained as a masked
    diffusion model with Dream's code. Its config.json is written by Dream's configuration class (model_type "Dream",
    DreamModel), so the loader cannot tell the two apart: `model_name` "diffucoder" picks this family. The math is Dream's; what
    differs is the default decoding strategy, d2f (bidirectional attention inside the prompt, block diffusion after
    it), which is how DiffuCoder is served with D2F adapters."""
    FAMILY = "diffucoder"
    MODEL_TYPES = ()  # config.json says "Dream": detection keeps it for the dream family
    ARCHITECTURES = ()
    DEFAULT_STRATEGY = "d2f"
