"""The plan's route to the other tensor-parallel ranks: the channel that carries an object in one frame down a pipe,
and the wire form that sends only what changed since the last step. Both ends must agree on every plan, step after
step, whatever its size and whichever requests come and go; a rank at either end that goes makes the other fail at
once, by name, and a worker that stops reading fails rank 0's send after a timeout, by name. After a failed send the
channel sends nothing more: a worker may hold part of a frame. A worker reads its plans on a descriptor that no
program it starts inherits."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import struct
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.plan import LogitBlock, RequestSampling, SchedulerOutput, SeqPlan
from diffulex_backend.plan_wire import FIELDS, PlanWire
from diffulex_backend.sampling import Confidence
from diffulex_backend.workers import Channel, RankFailure, frame


def pipe_ends():
    """A pipe's (read end, write end), buffered as Popen gives rank 0 a worker's stdin."""
    return (os.fdopen(fd, mode) for fd, mode in zip(os.pipe(), ("rb", "wb")))


def two_ranks(objects: list) -> list:
    """What rank 1 receives when rank 0 broadcasts `objects` in turn, down a pipe between two threads of this
    process, as down a worker's stdin. Rank 1 reads unbuffered, as a worker does: a read returns what the pipe holds,
    which may be part of a frame."""
    read_fd, write_fd = os.pipe()
    read_end, write_end = os.fdopen(read_fd, "rb", buffering=0), os.fdopen(write_fd, "wb")
    received, errors = [], []

    def receive() -> None:
        try:
            channel = Channel(None, 1, [read_end])
            received.extend(channel.broadcast() for _ in objects)
        except BaseException as error:  # noqa: BLE001 (reported by the test's thread)
            errors.append(error)
            read_end.close()  # a sender blocked on a full pipe then fails, instead of waiting for ever

    reader = threading.Thread(target=receive)
    reader.start()
    sender = Channel(None, 0, [write_end])
    try:
        assert [sender.broadcast(obj) for obj in objects] == objects  # rank 0 gets its own objects back
        assert sender.sent == len(objects)
    except RuntimeError:
        assert errors, "the sender failed while the reader did not"
    reader.join(60)
    read_end.close()
    write_end.close()
    assert not errors, errors
    return received


def test_objects_of_any_size_arrive_whole_and_in_order():
    # 3 MB is more than a pipe holds: the send waits for the reader, and the frame arrives whole all the same.
    objects = [None, "x", bytes(range(256)) * 400, {"k": [1, 2, 3]}, b"y" * 3_000_000, list(range(10))]
    assert two_ranks(objects) == objects


def test_a_worker_that_has_gone_fails_rank_0_s_next_plan_by_its_rank():
    read_end, write_end = pipe_ends()
    read_end.close()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 no longer reads its plans"):
        Channel(None, 0, [write_end]).broadcast("plan")


def bytes_in(pipe) -> int:
    """How many bytes wait in the pipe."""
    return struct.unpack("i", fcntl.ioctl(pipe, termios.FIONREAD, bytes(4)))[0]


def test_a_worker_that_stops_reading_fails_the_send_after_the_timeout_by_its_rank_and_every_later_send_at_once():
    read_end, write_end = pipe_ends()
    with read_end, write_end:
        sender = Channel(None, 0, [write_end], timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(RankFailure, match=r"^tensor-parallel rank 1 did not read its plan within 0\.3 s$"):
            sender.broadcast(b"x" * 4_000_000)
        assert 0.3 <= time.monotonic() - started < 5
        # The pipe holds the frame's first part. Emptied, it has room for the next frame, and still gets none of it:
        # the worker would take its bytes for the rest of the first frame.
        os.set_blocking(read_end.fileno(), False)
        while bytes_in(read_end):
            read_end.read()
        with pytest.raises(RankFailure, match=r"^the channel of plans broke at an earlier send: tensor-parallel rank "
                                              r"1 did not read its plan within 0\.3 s$"):
            sender.broadcast("plan")
        assert bytes_in(read_end) == 0 and sender.sent == 0


def test_a_worker_that_goes_while_rank_0_waits_for_room_fails_the_send_at_once():
    read_end, write_end = pipe_ends()
    sender = Channel(None, 0, [write_end], timeout_s=60)

    def close_once_full() -> None:
        # The send's first write fills the pipe; the send then waits for room.
        deadline = time.monotonic() + 30
        while not bytes_in(read_end) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        read_end.close()

    closer = threading.Thread(target=close_once_full)
    closer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="^tensor-parallel rank 1 no longer reads its plans"):
        sender.broadcast(b"x" * 4_000_000)
    assert time.monotonic() - started < 10
    closer.join()
    write_end.close()


def test_a_pipe_of_plans_holds_a_mebibyte_or_what_the_system_allows():
    read_end, write_end = pipe_ends()
    with read_end, write_end:
        default = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
        Channel(None, 0, [write_end])
        size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())  # binds processes without CAP_SYS_RESOURCE
        assert size == 1 << 20 or (limit < 1 << 20 and size == default)


@pytest.mark.parametrize("cut", [0, 3, 8, 20], ids=["between-frames", "in-the-header", "after-the-header",
                                                      "mid-frame"])
def test_a_worker_whose_rank_0_has_gone_stops_with_eof_wherever_the_frame_was_cut(cut):
    read_end, write_end = pipe_ends()
    write_end.write(frame(list(range(100)))[:cut])
    write_end.close()
    with pytest.raises(EOFError, match="rank 0 closed the pipe of plans"):
        Channel(None, 1, [read_end]).broadcast()
    read_end.close()


def descriptors_of(pid: int, pipe) -> list[int]:
    """The descriptors of process `pid` that hold `pipe` (either end: both ends are one inode)."""
    pipe_stat = os.fstat(pipe.fileno())
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # a descriptor closed meanwhile
            held = os.stat(f"/proc/{pid}/fd/{fd}")
            if (held.st_dev, held.st_ino) == (pipe_stat.st_dev, pipe_stat.st_ino):
                found.append(int(fd))
    return found


def test_a_worker_reads_its_plans_on_a_descriptor_no_program_it_starts_inherits_and_its_stdin_is_dev_null(
        llada_checkpoint):
    engine = Diffulex(llada_checkpoint, dtype="float64", max_num_reqs=2, max_model_len=64, tensor_parallel_size=2)
    try:
        worker = engine.workers.processes[0]
        assert os.readlink(f"/proc/{worker.pid}/fd/0") == os.devnull
        [fd] = descriptors_of(worker.pid, worker.stdin)
        assert fd > 2
        flags = re.search(r"^flags:\s+([0-7]+)$", Path(f"/proc/{worker.pid}/fdinfo/{fd}").read_text(), re.M)[1]
        assert int(flags, 8) & os.O_CLOEXEC  # closed in any program the worker starts
        # The plans keep arriving on it: every step of the generation runs on both ranks.
        [output] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(output.token_ids) == 8
    finally:
        engine.close()


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
