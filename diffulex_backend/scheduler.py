"""Continuous batching: which requests join each forward, within the token, request and page budgets, and what
each forward's result changes of them."""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from .config import Config
from .kv_cache import KVCacheManager
from .output import LogprobRecord, RequestDelta
from .plan import SchedulerOutput, SeqPlan
from .request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from .runner import StepResult


class Scheduler:
    def __init__(self, config: Config, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self.released: list[str] = []  # for the next plan that runs (SchedulerOutput.released)
        self.logprob_records: dict[str, LogprobRecord] = {}  # of the requests that ask for log-probabilities

    def add(self, req: Request) -> None:
        if req.params.logprobs is not None:
            self.logprob_records[req.request_id] = LogprobRecord(req.stop.max_tokens, req.params.logprobs)
        self.waiting.append(req)

    # ---- before the forward -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        num_preemptions = self.num_preemptions
        i = 0
        while i < len(self.running):
            req = self.running[i]
            plan = req.plan(budget)
            if plan is None:
                i += 1
                continue
            while not self.kv_cache.can_allocate(req, plan.cache_need):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            out.plans.append(self._allocate(req, plan))
            budget -= plan.num_tokens
            i += 1
        if self.num_preemptions == num_preemptions:  # else pages are short: admitting now would only preempt again
            self._admit(out, budget)
        if out.plans:  # a step with no plan does not run, and would not tell the runner
            out.released, self.released = self.released, []
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests, first in line first, while the request, token and page budgets allow."""
        held = []  # waiting for prompt pages a running request writes in this step (kv_cache.py)
        while self.waiting and len(self.running) < self.config.max_num_reqs and budget > 0:
            req = self.waiting[0]
            if self.kv_cache.waits_for_prefix(req):
                held.append(self.waiting.popleft())
                continue
            hit = self.kv_cache.allocate_prefix(req)
            req.num_cached = req.num_prefix_hit = hit
            plan = req.plan(budget)
            if plan is None or not self.kv_cache.can_allocate(req, plan.cache_need):
                self.kv_cache.free(req)
                req.reset_for_recompute()
                break
            self.kv_cache.record_prefix_lookup(req)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.plans.append(self._allocate(req, plan))
            budget -= plan.num_tokens
        self.waiting.extendleft(reversed(held))  # first in line again, in their order

    def _allocate(self, req: Request, plan: SeqPlan) -> SeqPlan:
        """Give the request the pages its plan touches; the plan then carries the grown page table."""
        self.kv_cache.allocate(req, plan.cache_need)
        plan.page_table = req.page_table.copy()
        return plan

    def preempt(self, req: Request) -> None:
        """Free the request's pages; it goes first in line and recomputes its cache when readmitted."""
        self.running.remove(req)
        self.kv_cache.free(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.released.append(req.request_id)
        self.num_preemptions += 1

    # ---- after the forward --------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: "StepResult") -> list[RequestDelta]:
        """Apply a forward's result to the requests of its plan: their cache bookkeeping, the tokens it decided,
        and the blocks that became final. Returns a delta per request that committed tokens, in plan order, after
        an error delta per request whose logits were not finite; the requests whose delta finishes them are finished
        here."""
        running = {req.request_id: req for req in self.running}
        for plan in sched.plans:  # every request of the plan took part in the forward, one that fails in it too
            running[plan.request_id].nfe += 1
        # A request whose logits were not finite ends before anything of its step is applied: its tokens are noise,
        # and its pages go back to the pool without being offered to the prefix cache.
        deltas = [self._fail_non_finite(running.pop(request_id)) for request_id in result.non_finite_logits]
        plans = [plan for plan in sched.plans if plan.request_id in running]
        reqs = [running[plan.request_id] for plan in plans]
        for plan, req in zip(plans, reqs):
            req.after_forward(plan)
            self.kv_cache.register_prefix(req)
        for request_id, (kept, num_context_pages) in result.retained_pages.items():
            if request_id in running:
                self.kv_cache.keep_pages(running[request_id], kept, num_context_pages)
        self._write_tokens(running, result)
        for plan, req in zip(plans, reqs):
            if not plan.blocks:
                continue
            old_end = req.committed_end
            if req.commit_ready_blocks():
                deltas.append(self._delta_since(req, old_end))
        return deltas

    def _write_tokens(self, running: dict[str, Request], result: "StepResult") -> None:
        """Write each predicted block's tokens back into its request, with what the strategy and the
        log-probability records keep of the step's predictions."""
        tokens = result.tokens.numpy()
        for plan, block, at in result.blocks:
            req, new = running.get(plan.request_id), tokens[at:at + block.end - block.start]
            if req is None:  # ended by this step: its logits were not finite
                continue
            record = self.logprob_records.get(plan.request_id)
            if record is not None:
                record.update(block.start - req.gen_start, req.tokens[block.start:block.end], new,
                              req.mask_token_id, result.logprobs, at)
            req.tokens[block.start:block.end] = new
            if result.predictions is not None:  # fed back as soft inputs (dmax)
                req.record_predictions(block.start, block.end, result.predictions, at)

    def _delta_since(self, req: Request, old_end: int) -> RequestDelta:
        """The output of the tokens committed past `old_end`, cut by the stop rule: a stop token (once min_tokens
        are out) ends the output before it, and max_tokens ends it after the block that reaches it."""
        new = req.tokens[old_end:req.committed_end]
        stop, reason = req.stop, None
        if stop.token_ids:
            hits = np.flatnonzero(np.isin(new, stop.token_ids))
            hits = hits[hits >= stop.min_tokens - (old_end - req.gen_start)]  # too early to stop
            if hits.size:
                new, reason = new[: hits[0]], FinishReason.STOP
        if reason is None and req.num_committed >= stop.max_tokens:
            reason = FinishReason.LENGTH
        ids = new.tolist()
        record = self.logprob_records.get(req.request_id)
        start = req.num_output_tokens
        logprobs = {} if record is None else record.output(start, start + len(ids))
        req.num_output_tokens += len(ids)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if reason is not None:
            self.finish(req, reason)
        return RequestDelta(request_id=req.request_id, token_ids=ids, finish_reason=reason,
                            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                            nfe=req.nfe, **logprobs)

    def _fail_non_finite(self, req: Request) -> RequestDelta:
        """End a request whose logits were not finite this step, with an error delta that says so."""
        self.finish(req, FinishReason.ERROR)
        return RequestDelta(request_id=req.request_id, token_ids=[], finish_reason=FinishReason.ERROR,
                            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                            nfe=req.nfe, error=non_finite_message(req.params.lora_name))

    def stop_at(self, req: Request, delta: RequestDelta, keep: int) -> RequestDelta:
        """A stop string ends the request after the first `keep` tokens of its delta (the text side matches stop
        strings): the rest of the delta is not output. Returns the delta cut there."""
        delta = delta.cut(keep)
        req.num_output_tokens = delta.num_output_tokens
        if req.is_finished:  # by max_tokens or a stop token, in the same block
            req.finish_reason = FinishReason.STOP
        else:
            self.finish(req, FinishReason.STOP)
        return delta

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End the request: its pages are freed now, and the runner forgets it with the next plan."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_cache.free(req)
        self.logprob_records.pop(req.request_id, None)
        self.released.append(req.request_id)
        req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, time.monotonic()


def non_finite_message(lora_name: str | None) -> str:
    """Why a request whose logits held NaN or infinities ends: the values of its adapter, or of the model itself,
    overflow somewhere in its forward."""
    adapter = "" if lora_name is None else f" under adapter {lora_name!r}"
    return (f"decoding failed: the model's logits for this request hold NaN or infinite values{adapter}, so its "
            "tokens would be noise")
