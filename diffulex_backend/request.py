"""Request state shared by every decoding strategy, and the plan (plan.py) a request makes for each step.

A request's sequence is its prompt followed by a generation area of `max_tokens` positions that start as the
mask token. The area is cut into blocks of `block_size` (the last one may be shorter). Committed tokens are
final and streamed; tokens whose K/V sit in the paged cache are counted by `num_cached`.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import numpy as np

from .sampling import SamplingMode
from .plan import LogitBlock, SeqPlan
from .resolve import ResolvedRequest
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .config import Config


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the request could not be decoded (its logits were not finite); the delta's error says why


class Request:
    """Base request: token buffer, bookkeeping, and the block layout. Strategies subclass it."""

    # The strategy never feeds the committed context again, so pages of it may be dropped (retention.py).
    SUPPORTS_PAGE_RETENTION = False

    @classmethod
    def check_prompt(cls, num_prompt_tokens: int, config: "Config") -> None:
        """Raise ValueError if a prompt of this length could never be scheduled."""

    # The config field that says how many blocks a request predicts in one step, or None: one. A remask threshold
    # acts on all but the first, and the thresholds that join and enable blocks (add_block_threshold,
    # semi_complete_threshold) on a second.
    BLOCKS_IN_FLIGHT_SETTING: str | None = None

    @classmethod
    def one_block_in_flight(cls, config: "Config") -> str | None:
        """None where a step may predict several blocks; else the condition that keeps it to one, as a phrase to
        follow the strategy's name in a refusal (" at buffer_size 1", or nothing for a strategy of one block)."""
        setting = cls.BLOCKS_IN_FLIGHT_SETTING
        if setting is None:
            return ""
        return f" at {setting} 1" if getattr(config, setting) == 1 else None

    @classmethod
    def check_strategy_params(cls, params: SamplingParams, config: "Config") -> None:
        """Raise Refusal for sampling parameters this strategy cannot honour, beyond the checks every strategy
        shares (resolve.check_params runs those first, always)."""

    def __init__(self, request_id: str, resolved: ResolvedRequest, config: "Config", mask_token_id: int,
                 shifted: bool):
        self.request_id = request_id
        self.shift = 1 if shifted else 0  # shifted models predict position i from the hidden state at i - 1
        self.params = params = resolved.params
        self.sampling = resolved.sampling
        self.stop = resolved.stop
        self.config = config  # the block layout and the strategy's settings
        self.mask_token_id = mask_token_id
        prompt_ids = resolved.prompt_ids
        self.num_prompt_tokens = len(prompt_ids)
        # numpy, not torch: the scheduler reads and writes a few slices of it per step, where a torch op costs
        # several microseconds and a numpy one well under one.
        self.tokens = np.full(len(prompt_ids) + params.max_tokens, mask_token_id, dtype=np.int64)
        self.tokens[: len(prompt_ids)] = prompt_ids
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_committed = 0  # generated tokens that are final
        self.num_committed_blocks = 0
        self.num_output_tokens = 0  # committed tokens returned to the user (stops at EOS, stop token, max_tokens)
        self.num_cached = 0  # positions [0, num_cached) have K/V in the cache
        self.num_prefix_hit = 0  # of them, tokens that came from the prefix cache at admission
        self.page_table: list[int] = []  # -1 marks a page dropped by page retention
        self.retention = resolved.retention
        self.retention_pending = self.retention is not None  # its pages are not chosen yet
        self.num_dropped_pages = 0
        self.prefix_hashes: list[int] | None = None  # filled by the KV cache manager
        self.num_registered_pages = 0
        self.nfe = 0  # forwards it took part in, counted by the scheduler for every strategy
        # Forwards that predicted tokens: the step in the noise key. Not nfe, which also counts prefill
        # chunks, whose number depends on what else shared the token budget.
        self.num_predict_steps = 0
        self.steps_in_block = 0  # steps taken on the current first block (top-k schedule, refresh interval)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    # ---- layout -------------------------------------------------------------------------------------------
    @property
    def gen_start(self) -> int:
        return self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.params.max_tokens // self.config.block_size)

    def block_span(self, k: int) -> tuple[int, int]:
        start = self.gen_start + k * self.config.block_size
        return start, min(start + self.config.block_size, self.gen_start + self.params.max_tokens)

    @property
    def committed_end(self) -> int:
        """Positions [0, committed_end) are final: the prompt and the committed blocks."""
        return self.gen_start + self.num_committed

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def num_transfer_schedule(self, block_len: int) -> list[int]:
        """LLaDA's schedule: spread a block's masked tokens evenly over `steps`, the remainder first."""
        steps = min(self.params.steps or block_len, block_len)
        base, extra = divmod(block_len, steps)
        return [base + (1 if i < extra else 0) for i in range(steps)]

    def transfer_count(self, block_len: int) -> int:
        if self.config.mode != SamplingMode.TOPK:
            return 0
        schedule = self.num_transfer_schedule(block_len)
        return schedule[min(self.steps_in_block, len(schedule) - 1)]

    # ---- the strategy's part -----------------------------------------------------------------------------
    def plan(self, token_budget: int) -> SeqPlan | None:
        """What to feed this step within `token_budget` tokens, or None if nothing fits."""
        raise NotImplementedError

    def make_plan(self, start: int, end: int, context_len: int, cache_index: np.ndarray, block_ids: np.ndarray,
                  blocks: list[LogitBlock]) -> SeqPlan:
        """A plan feeding positions [start, end), with copies of what the runner reads of this request. The
        first plan that predicts with the whole prompt in the context asks the runner to choose the pages to keep
        (page retention)."""
        measure = self.retention_pending and bool(blocks) and context_len >= self.num_prompt_tokens
        return SeqPlan(request_id=self.request_id, start=start, end=end, context_len=context_len,
                       token_ids=self.tokens[start:end].copy(), cache_index=cache_index, block_ids=block_ids,
                       blocks=blocks, page_table=self.page_table.copy(), committed_end=self.committed_end,
                       step=self.num_predict_steps, sampling=self.sampling, num_dropped_pages=self.num_dropped_pages,
                       retention=self.retention if measure else None)

    def after_forward(self, plan: SeqPlan) -> None:
        """Bookkeeping once the forward ran: K/V stored, predictions not yet applied."""
        raise NotImplementedError

    def commit_ready_blocks(self) -> int:
        """Commit what the last acceptance completed; returns how many generated tokens became final."""
        return self.commit_filled_blocks(self.num_blocks)

    def commit_filled_blocks(self, limit: int) -> int:
        """Commit leading blocks (below block `limit`) that hold no mask token any more."""
        before = self.num_committed
        while self.num_committed_blocks < limit:
            start, end = self.block_span(self.num_committed_blocks)
            if bool((self.tokens[start:end] == self.mask_token_id).any()):
                break
            self.num_committed_blocks += 1
            self.num_committed = end - self.gen_start
            self.steps_in_block = 0
        return self.num_committed - before

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone; committed and in-flight tokens stay and are recomputed."""
        self.num_cached = 0
        self.num_prefix_hit = 0
        self.page_table = []
        self.num_registered_pages = 0
        # A sparse request chooses its prompt pages again once it has recomputed them, from where it resumes.
        self.retention_pending, self.num_dropped_pages = self.retention is not None, 0
        self.status = RequestStatus.WAITING
