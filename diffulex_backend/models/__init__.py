"""Model families. Importing this package registers each one in `AutoModelForDiffusionLM`."""
from diffulex_backend.models import (  # noqa: F401  (registration by import)
    diffusion_gemma, dream, dream_reasoner, fast_dllm_v2, llada, llada2, sdar, sdar_moe, stable_diffcoder)
from diffulex_backend.models.decoder_lm import DecoderLM

__all__ = ["DecoderLM"]
