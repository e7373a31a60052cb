"""`fast_dllm`: Fast-dLLM's approximate cache for full-attention models.

At a block's first step (and every `cache_refresh_interval` steps, when set) the whole sequence is recomputed
and the K/V of the prefix before the current block are stored. The other steps feed only the current block and
the suffix after it, attending to the stored prefix. With `dual_cache` the suffix's K/V are stored too and a
step feeds the current block alone. Shifted models also feed the position before the block, whose hidden state
predicts the block's first token and changes as the block fills.
"""
from __future__ import annotations

import numpy as np

from ..acceptance import AcceptanceRule
from ..config import Config
from ..sampling import SamplingMode
from ..kv_cache import KVCacheManager
from ..registry import Strategy, register_strategy
from ..request import SeqPlan
from ..runner import ModelRunner
from ..scheduler import Scheduler
from .checks import check_buffer_size, check_whole_sequence_fits, refuse_prefix_caching
from .vanilla import FullAttentionRequest


class FastDLLMRequest(FullAttentionRequest):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_block = -1  # the block the stored K/V were computed for
        self.refreshing = False

    def _needs_refresh(self) -> bool:
        interval = self.config.cache_refresh_interval
        return (self.cache_block != self.num_committed_blocks
                or (interval > 0 and self.steps_in_block % interval == 0))

    def plan(self, token_budget: int) -> SeqPlan | None:
        start, end = self.block_span(self.num_committed_blocks)
        first_fed = start - self.shift
        dual = self.config.dual_cache
        self.refreshing = self._needs_refresh()
        if self.refreshing:
            if self.seq_len > token_budget:
                return None
            pos = np.arange(self.seq_len)
            suffix = np.where(pos >= end, pos - (end - first_fed), -1) if dual else -1
            return self.full_plan(np.where(pos < first_fed, pos, suffix))
        fed_end = end if dual else self.seq_len
        if fed_end - first_fed > token_budget:
            return None
        context = first_fed + (self.seq_len - end if dual else 0)
        n = fed_end - first_fed
        return self.make_plan(first_fed, fed_end, context, cache_index=np.full(n, -1, dtype=np.int64),
                              block_ids=np.zeros(n, dtype=np.int32), blocks=[self.current_block()])

    def after_forward(self, plan: SeqPlan) -> None:
        if self.refreshing:
            self.cache_block = self.num_committed_blocks
        super().after_forward(plan)

    def reset_for_recompute(self) -> None:
        super().reset_for_recompute()
        self.cache_block = -1


def validate_fast_dllm(config: Config) -> None:
    refuse_prefix_caching(config)
    check_buffer_size(config, 1)
    check_whole_sequence_fits(config)


register_strategy(Strategy(
    name="fast_dllm", request_cls=FastDLLMRequest, scheduler_cls=Scheduler, kv_cache_cls=KVCacheManager,
    runner_cls=ModelRunner, acceptance_cls=AcceptanceRule, default_sampling_mode=SamplingMode.THRESHOLD,
    supports_prefix_caching=False, validate=validate_fast_dllm, aliases=("fastdllm", "fast-dllm"),
    options=frozenset({"dual_cache", "cache_refresh_interval"}),
))
