"""Warm an engine before it takes requests: the first forward of each shape compiles Triton kernels and captures a
CUDA graph, which made the first generation after a load take several times as long as a warm one.

Short requests go through the real engine at each batch size the scheduler can form (1, 2, 4, ... up to
max_num_reqs, run largest first), so every decode bucket that serving will hit is compiled and captured now. Prefill runs eagerly, and
its kernels pick tiles by the number of tokens: one request per prompt length around each power of two (1, 2, 3,
5, 9, 17, ...) prefills at every tile size once. The attention kernel's launches, which also depend on context
lengths, are all compiled when the runner is built. On a CPU the kernels
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
    """Each batch size captures its buckets' graphs; without graphs, one size suffices. Past the requests whose
    blocks in flight fill a step's token budget, a larger batch steps in the same buckets (DiffusionGemma's
    256-token canvases: 16 requests at the default budget of 4096 tokens)."""
    if not engine.model.replays_graphs():
        return (1,)
    config = engine.config
    most = min(config.max_num_reqs, max(1, config.max_num_batched_tokens // (config.buffer_size * config.block_size)))
    sizes, size = [], 1
    while size < most:
        sizes.append(size)
        size *= 2
    return (*sizes, most)


def prefill_lengths(config, max_tokens: int) -> list[int]:
    """Prompt lengths on both sides of each power of two, up to one prefill chunk."""
    longest = min(config.max_num_batched_tokens, config.max_model_len - max_tokens)
    lengths, power = {1}, 1
    while power < longest:
        lengths.update((power, power + 1))
        power *= 2
    return sorted(length for length in lengths if length <= longest)


def run_to_completion(engine, tokens: int, size: int = 1) -> None:
    while engine.has_unfinished_requests():
        engine.step()
        if not engine.last_schedule.plans:
            raise RuntimeError(f"warm-up: {size} requests of {tokens} tokens could not be scheduled: the KV cache "
                               "or token budget is too small")


def warm_up(engine) -> WarmUpReport:
    """Run the warm-up requests; the engine is left with no request and every page free."""
    started = time.monotonic()
    config = engine.config
    prompt_len = min(config.block_size, config.max_model_len // 2)
    max_tokens = min(2 * config.buffer_size * config.block_size, config.max_model_len - prompt_len)
    token = (config.mask_token_id + 1) % engine.model.arch.vocab_size  # any token but the mask
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0)
    sizes = warm_up_batch_sizes(engine)
    lengths = prefill_lengths(config, max_tokens) if engine.model.fused_kernels else []
    longest = max([prompt_len, *lengths]) + max_tokens
    if not engine.kv_cache.holds(longest):  # only a num_kv_pages set by hand is so small
        raise ValueError(f"config field 'num_kv_pages' ({engine.kv_cache.num_pages}) holds fewer pages than the "
                         f"warm-up's longest request takes ({engine.kv_cache.pages_for(longest)} of {longest} "
                         "tokens): raise it (the offline API also loads with warm_up=False)")
    if engine.model.fused_kernels:
        # A token of its own per prompt: a prefix shared with an earlier one would shorten this prefill.
        vocab = engine.model.arch.vocab_size
        tokens = (t % vocab for t in range(token, token + vocab) if t % vocab != config.mask_token_id)
        for length, own in zip(lengths, tokens):
            engine.add_request([own] * length, params, request_id=f"warm-up-prefill-{length}")
            run_to_completion(engine, length + max_tokens)
    # Largest first: the graphs share one memory pool, and each smaller graph's activations then fit in blocks a
    # larger capture has freed, where the other way round every capture needs blocks larger than any freed yet.
    for size in reversed(sizes):
        size_started = time.monotonic()
        for i in range(size):
            engine.add_request([token] * prompt_len, params, request_id=f"warm-up-{size}-{i}")
        run_to_completion(engine, prompt_len + max_tokens, size)
        logger.info("warmed up batch size %d in %.1f s", size, time.monotonic() - size_started)
    report = WarmUpReport(seconds=time.monotonic() - started, batch_sizes=sizes)
    logger.info("warm-up took %.1f s over batch sizes %s", report.seconds, list(sizes))
    return report
