"""Continuous batching: which requests join each forward, within the token, request and page budgets."""
from __future__ import annotations

from collections import deque

from .config import Config
from .kv_cache import KVCacheManager
from .plan import SchedulerOutput, SeqPlan
from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: Config, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self.released: list[str] = []  # for the next plan that runs (SchedulerOutput.released)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

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

    def finish(self, req: Request) -> None:
        """Free the request's pages now; the runner forgets it with the next plan."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_cache.free(req)
        self.released.append(req.request_id)
