"""Triton GPU kernels for the diffulex engine, each the twin of a torch reference on the engine's CPU path.

Imported as `diffulex_kernels`. Under `TRITON_INTERPRET=1` they also run on CPU tensors (slowly), which is
how CI checks them.
"""
from .paged_attention import paged_attention
from .store_kv import store_kv

__all__ = ["paged_attention", "store_kv"]
