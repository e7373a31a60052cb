"""Warm an engine before it takes requests: the first forward of each shape compiles Triton kernels and captures a
CUDA graph, which made the first generation after a load take several times as long as a warm one.

Short requests go through the real engine at each batch size the scheduler can form (1, 2, 4, ... up to
max_num_reqs), so every decode bucket that serving will hit is compiled and captured now. On a CPU the kernels
are not used and one request suffices: it proves the model decodes end to end before the engine is handed over.

The warm-up leaves nothing behind that a later request could see: its requests have ids of their own and seeds of
their own (an unseeded one would draw from the engine's seed stream and shift every unseeded request after it),
and every page returns to the pool.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .sampling import SamplingParams

logger = logging.getLogger(__name__)


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
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0)
    sizes = warm_up_batch_sizes(engine)
    for size in sizes:
        size_started = time.monotonic()
        for i in range(size):
            engine.add_request([token] * prompt_len, params, request_id=f"warm-up-{size}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
            if not engine.last_schedule.plans:
                raise RuntimeError(f"warm-up: {size} requests of {prompt_len + max_tokens} tokens could not be "
                                   "scheduled: the KV cache or token budget is too small")
        logger.info("warmed up batch size %d in %.1f s", size, time.monotonic() - size_started)
    report = WarmUpReport(seconds=time.monotonic() - started, batch_sizes=sizes)
    logger.info("warm-up took %.1f s over batch sizes %s", report.seconds, list(sizes))
    return report
