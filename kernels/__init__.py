"""Triton GPU kernels for the diffulex engine, each the twin of a torch reference on the engine's CPU path.

Imported as `diffulex_kernels`. Under `TRITON_INTERPRET=1` they also run on CPU tensors (slowly), which is
how CI checks them.
"""
from .acceptance import accept_tokens
from .attention import paged_attention
from .kv_store import store_kv
from .moe import fused_moe
from .moe_routing import route_experts
from .norm import fused_add_rmsnorm, rmsnorm
from .sampling import sample_and_confidence

__all__ = [
    "accept_tokens", "fused_add_rmsnorm", "fused_moe", "paged_attention", "rmsnorm", "route_experts",
    "sample_and_confidence", "store_kv",
]
