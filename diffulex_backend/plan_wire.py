"""The step's plan as it travels from rank 0 to the other tensor-parallel ranks: what changed since the last step,
in few objects.

Pickled as it is, a plan is some 200 objects per 64 requests: three small arrays per request (the fed tokens,
their cache slots, their block ids), a page table of up to max_model_len / page_size entries and the sampling
record, although a request's sampling never changes and its page table changes only when it gains a page. The wire
form sends the arrays of every request as three concatenated arrays, and a request's sampling record and page table
only when they differ from those it had in the previous step. Both ends keep the previous step's records, so a
request that skips a step is sent whole when it comes back.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .plan import SchedulerOutput, SeqPlan

# Concatenated over the step's plans, and sent as int32: token ids sit below the vocabulary size and cache slots below
# the cache's pages x page_size, both far under 2^31. Each end's plans hold them in these dtypes.
ARRAYS = {"token_ids": np.int64, "cache_index": np.int64, "block_ids": np.int32}
CACHED = ("sampling", "page_table")  # sent when they differ from the request's previous step
FIELDS = tuple(f.name for f in dataclasses.fields(SeqPlan) if f.name not in ARRAYS)
UNCHANGED = None  # in place of a cached field (never None itself): the request's value of the previous step


def kept(value):
    """A cached field as an end keeps it: a page table copied, so that neither end's later plans share a list."""
    return list(value) if isinstance(value, list) else value


class PlanWire:
    """One end of the plan's route: rank 0 encodes, every other rank decodes. Each end keeps, by request id, the
    cached fields of the previous step's plans."""

    def __init__(self):
        self.previous: dict[str, tuple] = {}

    def encode(self, sched: SchedulerOutput) -> tuple:
        rows, current = [], {}
        for plan in sched.plans:
            cached = tuple(kept(getattr(plan, name)) for name in CACHED)
            before = self.previous.get(plan.request_id)
            row = [getattr(plan, name) for name in FIELDS]
            for name, value, old in zip(CACHED, cached, before or (object(),) * len(CACHED)):
                if value == old:
                    row[FIELDS.index(name)] = UNCHANGED
            rows.append(tuple(row))
            current[plan.request_id] = cached
        self.previous = current
        arrays = [np.concatenate([getattr(p, name) for p in sched.plans]).astype(np.int32) if sched.plans else None
                  for name in ARRAYS]
        rest = dataclasses.replace(sched, plans=[])
        return rest, rows, [len(p.token_ids) for p in sched.plans], arrays

    def decode(self, message: tuple) -> SchedulerOutput:
        rest, rows, lengths, arrays = message
        bounds = np.cumsum([0, *lengths]).tolist()
        arrays = [array.astype(dtype) for array, dtype in zip(arrays, ARRAYS.values()) if array is not None]
        plans, current = [], {}
        for i, row in enumerate(rows):
            fields = dict(zip(FIELDS, row))
            before = self.previous.get(fields["request_id"])
            for j, name in enumerate(CACHED):
                if fields[name] is UNCHANGED:
                    fields[name] = kept(before[j])
            fields.update({name: array[bounds[i]:bounds[i + 1]] for name, array in zip(ARRAYS, arrays)})
            plan = SeqPlan(**fields)
            plans.append(plan)
            current[plan.request_id] = tuple(kept(getattr(plan, name)) for name in CACHED)
        self.previous = current
        return dataclasses.replace(rest, plans=plans)
