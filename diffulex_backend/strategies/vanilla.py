"""`vanilla`: LLaDA's reference sampler. Every step recomputes the whole sequence with full attention and no
cache, and unmasks positions of the current block only (by default the `steps`-per-block top-k schedule of
low-confidence remasking). Slow by design: it is the oracle for full-attention models.
"""
from __future__ import annotations

import numpy as np

from ..acceptance import AcceptanceRule
from ..config import Config
from ..sampling import SamplingMode
from ..kv_cache import KVCacheManager
from ..registry import Strategy, register_strategy
from ..request import LogitBlock, Request, SeqPlan
from ..runner import ModelRunner
from ..scheduler import Scheduler
from .checks import check_buffer_size, check_whole_sequence_fits, refuse_prefix_caching


class FullAttentionRequest(Request):
    """One block decodes at a time; the rest of the generation area is fed as mask tokens."""

    @property
    def seq_len(self) -> int:
        return self.gen_start + self.params.max_tokens

    def current_block(self) -> LogitBlock:
        start, end = self.block_span(self.num_committed_blocks)
        return LogitBlock(start, end, is_first=True, enabled=True, num_transfer=self.transfer_count(end - start))

    def full_plan(self, cache_index: np.ndarray) -> SeqPlan:
        return self.make_plan(0, self.seq_len, 0, cache_index=cache_index,
                              block_ids=np.zeros(self.seq_len, dtype=np.int32), blocks=[self.current_block()])

    def after_forward(self, plan: SeqPlan) -> None:
        self.num_predict_steps += 1
        self.steps_in_block += 1


class VanillaRequest(FullAttentionRequest):
    def plan(self, token_budget: int) -> SeqPlan | None:
        if self.seq_len > token_budget:
            return None
        return self.full_plan(np.full(self.seq_len, -1, dtype=np.int64))


class NoKVCacheManager(KVCacheManager):
    """vanilla keeps no cache: a pool of zero pages."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool):
        super().__init__(0, page_size, False)


def validate_vanilla(config: Config) -> None:
    refuse_prefix_caching(config)
    check_buffer_size(config, 1)
    check_whole_sequence_fits(config)


register_strategy(Strategy(
    name="vanilla", request_cls=VanillaRequest, scheduler_cls=Scheduler, kv_cache_cls=NoKVCacheManager,
    runner_cls=ModelRunner, acceptance_cls=AcceptanceRule, default_sampling_mode=SamplingMode.TOPK,
    supports_prefix_caching=False, validate=validate_vanilla, aliases=("llada",),
))
