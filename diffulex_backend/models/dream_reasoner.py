"""Dream-reasoner (DreamLM/DreamReasoner-8B): Dream's layout and config keys on a Qwen3 decoder.

Per layer: q/k/v/o without bias and an RMSNorm on each head's q and k before RoPE (Qwen3); config.json carries
`head_dim`, `attention_bias` and the training `block_size` beside Dream's keys. Not shifted: position i predicts
the token at position i. Its config.json says model_type "Dream", so `model_name` "dream_reasoner" picks this
family (detection would take Dream, whose weights have no q/k norm and do have q/k/v biases).
"""
from __future__ import annotations

from diffulex_backend.models.qwen import QWEN_CONFIG_KEYS, QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("dream_reasoner")
class DreamReasonerModel(QwenModel):
    FAMILY = "dream_reasoner"
    MODEL_TYPES = ()  # "Dream" is the dream family's
    ARCHITECTURES = ()
    CONFIG_KEYS = QWEN_CONFIG_KEYS | {"attention_bias", "block_size", "head_dim"}
    QK_NORM = True
