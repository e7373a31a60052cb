"""`fast_dllm_v2`: Fast-dLLM v2's block decoding with sub-blocks, for models trained block-causally from an AR
model (the `fast_dllm_v2` family).

It follows the reference generation code (NVlabs/Fast-dLLM, v2/generation_functions.py, `batch_sample` without
the block cache) step for step:
- Blocks are aligned to absolute positions (multiples of `block_size`), as the model was trained. Attention is
  block-causal over the whole sequence, prompt included: a position sees every earlier block and its own block
  both ways. The prompt's whole blocks are prefilled into the cache; its last, partial block is the first block
  decoded, fed together with the masked positions that complete it, and stored only once the block is full.
- A block is fed whole at every step (K/V not stored) and decoded in sub-blocks of `sub_block_size`, left to
  right: a step predicts the masked positions of the first sub-block that still holds a mask, with the block's
  later positions still masked, and accepts every one whose confidence clears the threshold, and at least the
  most confident one.
- Logits are shifted: position i is predicted from the hidden state at i - 1. So the first position of a block
  is predicted from the last position of the block before it, in the forward that stores that completed block:
  one forward stores block k and decodes block k + 1's first token, which the next forward then feeds. That
  token is the one prediction of its step, so it is always accepted (the reference takes its argmax).
- A full block commits and streams; its K/V enter the cache in that next forward. Committed blocks and the
  prompt's whole blocks are the cache, so prefix caching works as for multi_bd, at whole blocks: a cached page
  is reused only up to a block boundary, since a prompt position's K/V depend on the rest of its block.
Deviations, all at the edges: acceptance is confidence >= threshold (the reference: >); the mask token is
never predicted; a generation area that ends inside a block (max_tokens) feeds that block only up to its end.
"""
from __future__ import annotations

import math

import numpy as np

from ..acceptance import AcceptanceRule
from ..config import Config
from ..sampling import SamplingMode
from ..kv_cache import KVCacheManager
from ..refusal import Refusal
from ..registry import Strategy, register_strategy
from ..request import LogitBlock, Request, SeqPlan
from ..runner import ModelRunner
from ..sampling import SamplingParams
from ..scheduler import Scheduler
from .checks import check_batched_tokens, check_buffer_size


def sub_block_size_error(sub_block_size: int, block_size: int, where: str) -> str | None:
    if block_size % sub_block_size:
        return f"{where} 'sub_block_size' ({sub_block_size}) must divide block_size ({block_size})"
    return None


class FastDLLMv2Request(Request):
    @classmethod
    def check_strategy_params(cls, params: SamplingParams, config: Config) -> None:
        if params.sub_block_size is not None:
            error = sub_block_size_error(params.sub_block_size, config.block_size, "sampling parameter")
            if error:
                raise Refusal(error, "sub_block_size")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sub_block_size = self.params.sub_block_size or self.config.sub_block_size

    # ---- layout: blocks at absolute positions -------------------------------------------------------------
    @property
    def gen_end(self) -> int:
        return self.gen_start + self.params.max_tokens

    @property
    def first_block_start(self) -> int:
        """The absolute start of the block that holds the first generated position."""
        return self.gen_start // self.config.block_size * self.config.block_size

    @property
    def num_blocks(self) -> int:
        return -(-(self.gen_end - self.first_block_start) // self.config.block_size)

    def block_span(self, k: int) -> tuple[int, int]:
        """Block k's generated positions: its absolute span, clipped to the generation area."""
        start = self.first_block_start + k * self.config.block_size
        return max(start, self.gen_start), min(start + self.config.block_size, self.gen_end)

    def block_ids(self, positions: np.ndarray) -> np.ndarray:
        bs = self.config.block_size
        return (positions // bs * bs).astype(np.int32)

    # ---- the step -----------------------------------------------------------------------------------------
    def plan(self, token_budget: int) -> SeqPlan | None:
        bs = self.config.block_size
        start = self.num_cached
        block = self.first_block_start + self.num_committed_blocks * bs  # the block being decoded
        block_end = min(block + bs, self.gen_end)
        if block >= self.gen_start and self.tokens[block] == self.mask_token_id:
            # Its first token: predicted from the position before it, fed with the block that ends there.
            end, blocks = block + 1, [LogitBlock(block, block + 1, True, True, 0)]
        else:
            end, blocks = block_end, [self._sub_block(block, block_end)]
        if end - start > token_budget:
            # Only the prompt's whole blocks (or a recompute after preemption) can be fed in chunks.
            end, blocks = start + (min(block, start + token_budget) - start) // bs * bs, []
            if end <= start:
                return None
        positions = np.arange(start, end)
        return self.make_plan(start, end, start, cache_index=np.where(positions < block, positions, -1),
                              block_ids=self.block_ids(positions), blocks=blocks)

    def _sub_block(self, block: int, block_end: int) -> LogitBlock:
        """The first sub-block of the block that holds a mask; its positions from the first generated one, and
        never the block's first position, which is filled before the sub-blocks start."""
        first_masked = int(np.flatnonzero(self.tokens[block:block_end] == self.mask_token_id)[0])
        sub = block + first_masked // self.sub_block_size * self.sub_block_size
        lo = max(sub, self.gen_start, block + 1)
        return LogitBlock(lo, min(sub + self.sub_block_size, block_end), True, True, 0)

    def after_forward(self, plan: SeqPlan) -> None:
        self.num_cached = max(self.num_cached, plan.start + int(np.count_nonzero(plan.cache_index >= 0)))
        if plan.blocks:
            self.steps_in_block += 1
            self.num_predict_steps += 1


class BlockAlignedPrefixCache(KVCacheManager):
    """Prefix reuse for block-causal prompts: a prompt position's K/V depend on its whole block, so only pages
    of the prompt's whole blocks are registered, and a hit is cut back to a boundary of both a page and a block."""

    def _prefix_hashes(self, req: Request) -> list[int]:
        if req.prefix_hashes is None:
            # The base hashes the pages of the prompt's first P - 1 tokens; keep those inside whole blocks.
            bs = req.config.block_size
            whole_blocks = req.num_prompt_tokens // bs * bs
            req.prefix_hashes = super()._prefix_hashes(req)[: whole_blocks // self.page_size]
        return req.prefix_hashes

    def allocate_prefix(self, req: Request) -> int:
        hit = super().allocate_prefix(req)
        unit = math.lcm(self.page_size, req.config.block_size)
        keep = hit // unit * unit
        while len(req.page_table) * self.page_size > keep:
            page = req.page_table.pop()
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_cached[page] = None  # a hit page has a hash: it stays findable
        return keep


def validate_fast_dllm_v2(config: Config) -> None:
    error = sub_block_size_error(config.sub_block_size, config.block_size, "config field")
    if error:
        raise ValueError(error)
    check_buffer_size(config, 1)
    if config.mode != SamplingMode.THRESHOLD:
        raise ValueError("config field 'sampling_mode' must be 'threshold' for decoding_strategy 'fast_dllm_v2' "
                         f"(it decodes each sub-block by threshold), got '{config.sampling_mode}'")
    check_batched_tokens(config, config.block_size + 1, "the block being committed and the next block's first position")


register_strategy(Strategy(
    name="fast_dllm_v2", request_cls=FastDLLMv2Request, scheduler_cls=Scheduler, kv_cache_cls=BlockAlignedPrefixCache,
    runner_cls=ModelRunner, acceptance_cls=AcceptanceRule, default_sampling_mode=SamplingMode.THRESHOLD,
    supports_prefix_caching=True, validate=validate_fast_dllm_v2, aliases=("fast-dllm-v2", "fastdllm_v2"),
    options=frozenset({"sub_block_size"}),
))
