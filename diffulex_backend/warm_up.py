"""Warm an engine before it takes requests: the first forward of each shape compiles Triton kernels and captures a
CUDA graph, which made the first generation after a load take several times as long as a warm one.

Short requests go through the real engine at each batch size the scheduler can form (1, 2, 4, ... up to
max_num_reqs), so every decode bucket that serving will hit is compiled and captured now. On a CPU the kernels
are not used and one request suffices: it proves the model decodes end to end before the server calls it ready.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .sampling import SamplingParams


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    batch_sizes: tuple[int, ...]


def warm_up_batch_sizes(engine) -> tuple[int, ...]:
    if not engine.model.fused_kernels:
        return (1,)
    sizes, size = [], 1
    while size < engine.config.max_num_reqs:
        sizes.append(size)
        size *= 2
    return (*sizes, engine.config.max_num_reqs)


def warm_up(engine) -> WarmUpReport:
    """Run the warm-up requests; the engine is left with no request and every page free."""
    started = time.monotonic()
    config = engine.config
    prompt_len = min(config.block_size, config.max_model_len // 2)
    max_tokens = min(2 * config.buffer_size * config.block_size, config.max_model_len - prompt_len)
    token = (config.mask_token_id + 1) % engine.model.arch.vocab_size  # any token but the mask
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sizes = warm_up_batch_sizes(engine)
    for size in sizes:
        engine.generate([[token] * prompt_len] * size, params)
    return WarmUpReport(seconds=time.monotonic() - started, batch_sizes=sizes)
