"""The hand-off from scheduler to runner, one per step: plain values only.

A plan holds copies, never a reference to a request: the runner reads nothing else of the engine's state, so a
plan can be broadcast to other ranks as it is, and a step cannot see a request change under it. Every value a
step packs into a tensor was validated when its request was prepared, so packing cannot fail on one request.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from .retention import Retention
from .sampling import Confidence


@dataclass(frozen=True)
class RequestSampling:
    """A request's sampling settings, fixed when it is added."""

    seed: int  # < 2**32: the noise hash's key
    temperature: float
    top_k: int  # 0 keeps the whole vocabulary; never past it
    top_p: float
    confidence_kind: Confidence
    accept_threshold: float
    remask_threshold: float
    lora_index: int = -1  # the request's adapter: its slot in the model's LoRA stacks; -1 = none
    edit_threshold: float = 0.0  # dmax: above 0, decoded tokens of blocks in flight follow the new predictions
    logprobs: int = -1  # -1: none; k >= 0: each accepted token's log-probability and the step's k most likely tokens
    # min_tokens: positions before banned_until (absolute) never predict banned_ids (EOS and stop tokens)
    banned_until: int = 0
    banned_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LogitBlock:
    """A span of positions whose predictions the acceptance rule decides on this step."""

    start: int
    end: int
    is_first: bool  # the first block in flight: it must make progress
    enabled: bool  # may accept tokens (its predecessor is semi-complete)
    num_transfer: int  # tokens to unmask this step under the top-k schedule


@dataclass
class SeqPlan:
    """One request's part of one forward: which positions are fed, stored, and predicted, and how to sample."""

    request_id: str
    start: int  # feed positions [start, end)
    end: int
    context_len: int  # cached tokens this sequence attends to
    token_ids: np.ndarray  # [end - start] int64: the tokens fed, a copy
    cache_index: np.ndarray  # [end - start] int64: logical cache slot of each fed token, -1 = not stored
    block_ids: np.ndarray  # [end - start] int32: the block mask (see attention.py)
    blocks: list[LogitBlock]  # predicted spans inside [start, end), in position order; empty for a prefill chunk
    # The request's pages, a copy. The scheduler replaces it once it has allocated the pages cache_need asks for.
    page_table: list[int]
    committed_end: int  # positions [0, committed_end) are final; shifted models keep the hidden state before it
    step: int  # forwards of this request that predicted tokens before this one: the step in the noise key
    sampling: RequestSampling
    # Soft inputs (dmax), or None when every position is fed as its token. Row i of the fed positions is fed as
    # the mixture of the embeddings of soft_ids[i] with weights soft_coef[i, :K], mixed into its token's
    # embedding by soft_coef[i, K] (0: the token's embedding alone). See models/decoder_lm.py soft_embeddings.
    soft_ids: np.ndarray | None = None  # [end - start, K] int64
    soft_coef: np.ndarray | None = None  # [end - start, K + 1] float32
    # Page retention (retention.py): holes (-1) in page_table, all inside the context; and, on the one step that
    # chooses them, what to measure.
    num_dropped_pages: int = 0
    retention: Retention | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @functools.cached_property
    def cache_need(self) -> int:
        """Logical cache slots the plan touches, i.e. how far the page table must reach."""
        stored = int(self.cache_index.max()) + 1 if self.num_tokens else 0
        return max(self.context_len, stored)


@dataclass
class SchedulerOutput:
    """The one hand-off from scheduler to runner: a plan per request in this forward."""

    plans: list[SeqPlan] = field(default_factory=list)
    # Requests finished, aborted or preempted since the last plan that ran: the runner forgets their state before
    # this step. A preempted request recomputes from scratch; an id may come back as a new request.
    released: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.plans)
