"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): Qwen2.5 weights trained as a masked diffusion model.

Shifted: the logits at position i predict the token at position i + 1, as in the AR model it started from.
"""
from __future__ import annotations

from diffulex_backend.models.qwen import QwenModel
from diffulex_backend.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("dream")
class DreamModel(QwenModel):
    FAMILY = "dream"
    MODEL_TYPES = ("Dream", "dream")
    ARCHITECTURES = ("DreamModel",)
    QKV_BIAS = True
    SHIFTED = True


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
