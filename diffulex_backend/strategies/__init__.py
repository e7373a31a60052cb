"""Decoding strategies. Each module registers one Strategy record per strategy it implements (registry.py);
importing this package registers them all."""
from . import block_diffusion, diffusion_gemma, dmax, fast_dllm, fast_dllm_v2, vanilla

__all__ = ["block_diffusion", "diffusion_gemma", "dmax", "fast_dllm", "fast_dllm_v2", "vanilla"]
