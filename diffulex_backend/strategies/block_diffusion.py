"""Block diffusion with several blocks in flight (`multi_bd`), and D2F (`d2f`): the same with a prompt that
attends bidirectionally within itself.

A block goes DUMMY (not joined: all mask, not fed) -> ACTIVE (in flight: fed every step, accepting tokens) ->
TO_CACHE (committed: fed once more so that its final K/V reach the cache) -> IN_CACHE. The blocks of a request
are in that order from last to first, so three counters are the whole state, never a per-block object:
  IN_CACHE: ends at or before position num_cached | TO_CACHE: the rest below num_committed_blocks |
  ACTIVE: the rest below num_joined_blocks | DUMMY: the rest.
One forward feeds, contiguously from the first uncached position: the rest of the prompt, the TO_CACHE blocks
(their K/V are stored now; no extra forward per block), and the ACTIVE blocks (predicted, not stored).
"""
from __future__ import annotations

import numpy as np

from ..acceptance import AcceptanceRule
from ..config import BLOCK_THRESHOLDS, Config
from ..sampling import SamplingMode
from ..kv_cache import KVCacheManager
from ..registry import Strategy, register_strategy
from ..request import LogitBlock, Request, SeqPlan
from ..runner import ModelRunner
from ..scheduler import Scheduler
from .checks import check_batched_tokens, check_buffer_size, refuse_prefix_caching


class BlockDiffusionRequest(Request):
    causal_prompt = True
    SUPPORTS_PAGE_RETENTION = True
    BLOCKS_IN_FLIGHT_SETTING = "buffer_size"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_joined_blocks = 1
        self._join_blocks()

    def block_ids(self, positions: np.ndarray) -> np.ndarray:
        """Each position's block id: its block's first position in the generation area; in the prompt, the
        position itself (causal) or 0 (bidirectional)."""
        bs, gen_start = self.config.block_size, self.gen_start
        ids = ((positions - gen_start) // bs * bs + gen_start).astype(np.int32)
        num_prompt = gen_start - int(positions[0]) if positions.size else 0
        if num_prompt > 0:
            ids[:num_prompt] = positions[:num_prompt] if self.causal_prompt else 0
        return ids

    def _chunk_end(self, start: int, limit: int) -> int:
        """The furthest legal end of a prefill chunk: never inside a block, nor inside a d2f prompt."""
        if limit >= self.committed_end:
            return self.committed_end
        if limit < self.gen_start:
            return limit if self.causal_prompt else start
        bs = self.config.block_size
        end = self.gen_start + (limit - self.gen_start) // bs * bs
        return end if end > start else start

    def fill_ratio(self, k: int) -> float:
        start, end = self.block_span(k)
        return int(np.count_nonzero(self.tokens[start:end] != self.mask_token_id)) / (end - start)

    def plan(self, token_budget: int) -> SeqPlan | None:
        start = self.num_cached
        active_end = self.block_span(self.num_joined_blocks - 1)[1]
        end = active_end if active_end - start <= token_budget else self._chunk_end(start, start + token_budget)
        if end <= start:
            return None
        positions = np.arange(start, end)
        write_end = min(end, self.committed_end)
        blocks = []
        if end == active_end:
            for k in range(self.num_committed_blocks, self.num_joined_blocks):
                b0, b1 = self.block_span(k)
                first = k == self.num_committed_blocks
                enabled = first or self.fill_ratio(k - 1) >= self.config.semi_complete_threshold
                blocks.append(LogitBlock(b0, b1, first, enabled, self.transfer_count(b1 - b0)))
        return self.make_plan(start, end, self.num_cached, cache_index=np.where(positions < write_end, positions, -1),
                              block_ids=self.block_ids(positions), blocks=blocks)

    def after_forward(self, plan: SeqPlan) -> None:
        self.num_cached = max(self.num_cached, min(plan.end, self.committed_end))
        if plan.blocks:
            self.steps_in_block += 1
            self.num_predict_steps += 1

    def commit_ready_blocks(self) -> int:
        committed = self.commit_filled_blocks(self.num_joined_blocks)
        self._join_blocks()
        return committed

    def _join_blocks(self) -> None:
        while (self.num_joined_blocks < self.num_blocks
               and self.num_joined_blocks - self.num_committed_blocks < self.config.buffer_size):
            in_flight = self.num_joined_blocks > self.num_committed_blocks
            if in_flight and self.fill_ratio(self.num_joined_blocks - 1) < self.config.add_block_threshold:
                break
            self.num_joined_blocks += 1


class D2FRequest(BlockDiffusionRequest):
    causal_prompt = False

    @classmethod
    def check_prompt(cls, num_prompt_tokens: int, config: Config) -> None:
        # The prompt attends bidirectionally within itself, so it cannot be split into chunks.
        if num_prompt_tokens > config.max_num_batched_tokens:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens; decoding_strategy 'd2f' prefills a prompt in "
                             f"one forward, so it must fit max_num_batched_tokens ({config.max_num_batched_tokens})")


def validate_multi_bd(config: Config) -> None:
    check_buffer_size(config, 64)
    check_batched_tokens(config, (config.buffer_size + 1) * config.block_size,
                         "the blocks in flight plus the block being committed")


def validate_d2f(config: Config) -> None:
    refuse_prefix_caching(config)
    validate_multi_bd(config)


register_strategy(Strategy(
    name="multi_bd", request_cls=BlockDiffusionRequest, scheduler_cls=Scheduler, kv_cache_cls=KVCacheManager,
    runner_cls=ModelRunner, acceptance_cls=AcceptanceRule, default_sampling_mode=SamplingMode.THRESHOLD,
    supports_prefix_caching=True, validate=validate_multi_bd, aliases=("block_diffusion", "bd"),
    options=BLOCK_THRESHOLDS,
), default=True)
register_strategy(Strategy(
    name="d2f", request_cls=D2FRequest, scheduler_cls=Scheduler, kv_cache_cls=KVCacheManager,
    runner_cls=ModelRunner, acceptance_cls=AcceptanceRule, default_sampling_mode=SamplingMode.THRESHOLD,
    supports_prefix_caching=False, validate=validate_d2f, aliases=("diffusion_forcing",), options=BLOCK_THRESHOLDS,
))
