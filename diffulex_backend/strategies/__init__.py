"""Decoding strategies. Each module registers its request, scheduler, KV cache manager, runner and sampler
classes under its name; importing this package registers them all."""
from ..registry import AutoKVCacheManager, AutoModelRunner, AutoReq, AutoSampler, AutoScheduler
from . import block_diffusion, fast_dllm, vanilla

__all__ = ["AutoKVCacheManager", "AutoModelRunner", "AutoReq", "AutoSampler", "AutoScheduler",
           "block_diffusion", "fast_dllm", "vanilla"]
