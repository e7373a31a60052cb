"""The plan's route to the other tensor-parallel ranks: the channel that carries an object in one broadcast, and
the wire form that sends only what changed since the last step. Both ends must agree on every plan, step after step,
whatever fits the channel's buffer and whichever requests come and go."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch.distributed as dist

from diffulex_backend.plan import LogitBlock, RequestSampling, SchedulerOutput, SeqPlan
from diffulex_backend.plan_wire import FIELDS, PlanWire
from diffulex_backend.sampling import Confidence
from diffulex_backend.workers import Channel


def two_ranks(objects: list, capacity: int) -> tuple[list, list[int]]:
    """What rank 1 receives when rank 0 broadcasts `objects` in turn over a gloo group of two ranks (threads of this
    process), and rank 1's buffer size after each."""
    store = dist.HashStore()
    received, sizes, errors = [], [], []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, r, 2)
            channel = Channel(group, r, capacity)
            for obj in objects:
                got = channel.broadcast(obj if r == 0 else None)
                if r == 1:
                    received.append(got)
                    sizes.append(channel.buffer.numel())
        except BaseException as error:  # noqa: BLE001 (reported by the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return received, sizes


def test_objects_of_any_size_arrive_whole_and_the_buffer_keeps_its_size():
    objects = [None, "x", bytes(range(256)) * 400, {"k": [1, 2, 3]}, b"y" * 300_000, list(range(10))]
    received, sizes = two_ranks(objects, capacity=1024)
    assert received == objects
    # 102400 and 300000 bytes do not fit 1016: their rest follows, and the buffer every step sends stays small.
    assert sizes == [1024] * len(objects)


def plan(request_id: str, start: int, pages: list[int], seed: int = 1, tokens: int = 4) -> SeqPlan:
    sampling = RequestSampling(seed=seed, temperature=0.0, top_k=0, top_p=1.0, confidence_kind=Confidence.PROB,
                               accept_threshold=0.9, remask_threshold=0.0)
    return SeqPlan(request_id=request_id, start=start, end=start + tokens, context_len=start,
                   token_ids=np.arange(start, start + tokens, dtype=np.int64) * 1000,
                   cache_index=np.arange(start, start + tokens, dtype=np.int64),
                   block_ids=np.zeros(tokens, dtype=np.int32),
                   blocks=[LogitBlock(start, start + tokens, True, True, 1)], page_table=pages,
                   committed_end=start, step=start, sampling=sampling)


def assert_same(a: SchedulerOutput, b: SchedulerOutput) -> None:
    assert a.released == b.released and len(a.plans) == len(b.plans)
    for x, y in zip(a.plans, b.plans):
        for field in dataclasses.fields(SeqPlan):
            mine, theirs = getattr(x, field.name), getattr(y, field.name)
            if isinstance(mine, np.ndarray):
                assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), field.name
            else:
                assert mine == theirs, field.name


def test_the_wire_form_rebuilds_every_plan_and_sends_a_request_s_records_only_when_they_change():
    steps = [
        SchedulerOutput(plans=[plan("a", 0, [3]), plan("b", 0, [4, 5], seed=2)]),
        SchedulerOutput(plans=[plan("a", 4, [3]), plan("b", 4, [4, 5], seed=2)]),  # nothing cached changed
        SchedulerOutput(plans=[plan("a", 8, [3, 9]), plan("c", 0, [6], seed=3)]),  # a gains a page; c is new
        SchedulerOutput(plans=[plan("b", 8, [4, 5], seed=2)], released=["a", "c"]),  # b skipped a step: sent whole
        SchedulerOutput(),
        SchedulerOutput(plans=[plan("b", 12, [4, 5], seed=2, tokens=0)]),
    ]
    sender, receiver = PlanWire(), PlanWire()
    sent = []
    for sched in steps:
        message = sender.encode(sched)
        sent.append(message[1])
        assert_same(receiver.decode(message), sched)
    page_table, sampling = FIELDS.index("page_table"), FIELDS.index("sampling")

    def cached(step: int, row: int) -> tuple[bool, bool]:
        return sent[step][row][page_table] is not None, sent[step][row][sampling] is not None

    assert [cached(0, 0), cached(0, 1)] == [(True, True), (True, True)]
    assert [cached(1, 0), cached(1, 1)] == [(False, False), (False, False)]
    assert [cached(2, 0), cached(2, 1)] == [(True, False), (True, True)]
    assert cached(3, 0) == (True, True)


def test_a_plan_decoded_from_the_wire_shares_no_page_table_with_the_next():
    sender, receiver = PlanWire(), PlanWire()
    first = receiver.decode(sender.encode(SchedulerOutput(plans=[plan("a", 0, [3])])))
    first.plans[0].page_table.append(99)  # a later change to one step's plan
    second = receiver.decode(sender.encode(SchedulerOutput(plans=[plan("a", 4, [3])])))
    assert second.plans[0].page_table == [3]


@pytest.mark.parametrize("value", [2**31 - 1, 0])
def test_token_ids_and_cache_slots_keep_their_values_through_the_int32_wire(value):
    sched = SchedulerOutput(plans=[dataclasses.replace(plan("a", 0, [3]), token_ids=np.array([value] * 4),
                                                       cache_index=np.array([value, -1, 0, 1]))])
    assert_same(PlanWire().decode(PlanWire().encode(sched)), sched)
