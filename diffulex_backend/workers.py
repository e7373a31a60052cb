"""Tensor-parallel ranks as processes.

Rank 0 is the engine's own process: the scheduler, the tokenizer and rank 0's share of the model. Ranks 1..N-1
are worker processes started here (running `workers.main`); each holds its share of the model and
runs the same runner, step for step:
- each step rank 0 sends the plan down a pipe to each worker, in its wire form (plan_wire.py: what changed since
  the last step);
- every rank runs the forward, whose collectives (NCCL on GPUs, or for small sums a one-shot kernel over the
  other GPUs' memory; gloo on CPU) put the shares together;
- every rank gets the whole logits (compute_logits gathers them) and samples the same tokens from the same seeds,
  so nothing travels back to rank 0.

Each rank's intra-op thread pool gets an equal share of the cores the engine's process may use (rank_threads), unless
OMP_NUM_THREADS sets it: N ranks that each size their pool to every core oversubscribe them, and a parallel region's
closing barrier then waits for threads that the other ranks' pools keep off the cores, which turns a step's host work
of microseconds into milliseconds.

Failure never hangs the engine. A worker that dies closes its pipe and sockets, so rank 0's next plan or collective
fails at once; the engine then raises RankFailure, naming the rank and its exit status, or the error the worker left
in the group's store before it exited. Collectives also time out (COLLECTIVE_TIMEOUT) for a rank that hangs without
dying, and so does the send of a plan that waits for room in the pipe of a worker that does not read it (a
RankFailure naming the rank). Workers exit when told to, when a collective fails, or when rank 0's process is gone
(they watch their parent); `WorkerGroup.close` tells them to stop and kills what is left; a group collected without
it, or still open when the interpreter exits, kills its workers.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import BinaryIO

import torch
import torch.distributed as dist

from .config import Config
from .model_setup import build_runner, load_rank_model, resolve_dtype
from .peer_memory import connect_peers
from .plan_wire import PlanWire
from .tensor_parallel import TensorParallel

# The longest a collective may wait for another rank: a step, or a rank still loading its share at start.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STOP_TIMEOUT_S = 10.0  # how long close() waits for workers told to stop before killing them
FAILURE_KEY = "failure/{}"  # where a failing worker leaves its error, in the group's store


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, failed, or stopped answering: the engine cannot go on."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of an engine on cuda:d runs on cuda:d+r; on the CPU every rank is a process on the CPU. The engine's
    device is resolved (model_setup.resolve_device), so a GPU always carries its index."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", device.index + rank)


def connect(store, rank: int, size: int, device: torch.device, expert_parallel: bool) -> tuple[object, TensorParallel]:
    """The control group of one engine's ranks, and this rank's TensorParallel. Control answers questions to every rank
    (Channel.minimum), on the host, over gloo; the model's collectives go over NCCL on GPUs (the small sums over peer memory, where every
    pair of GPUs reaches the other's: peer_memory.py), over gloo on the CPU."""
    def gloo(prefix):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = COLLECTIVE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # the ranks share a host
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)

    control = gloo("control")
    if device.type != "cuda":
        return control, TensorParallel(rank, size, expert_parallel, gloo("data"))
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = COLLECTIVE_TIMEOUT
    data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, size, options)
    peer = connect_peers(dist.PrefixStore("peer", store), rank, size, device, COLLECTIVE_TIMEOUT)
    return control, TensorParallel(rank, size, expert_parallel, data, peer)


class Channel:
    """Rank 0 -> every rank: pickled objects, each in one frame (its size, then its bytes), over the pipe from rank 0
    to each worker (which came to the worker as its stdin).

    A pipe wakes its blocked reader at once, and a write returns as soon as the bytes sit in the pipe: rank 0 goes on
    to its own forward while the workers read, where a broadcast over the gloo group held it for a round trip of
    the loopback's sockets every step (benchmarks/plan_broadcast.py times both). A frame larger than a pipe's free
    space waits for the worker to read, up to `timeout_s`: a worker alive but not reading by then fails the send with
    the RankFailure that names it. A worker that has gone makes the send fail at once, also while it waits. A failed
    send may leave part of a frame in a pipe, which the next frame's bytes would complete into garbage: the channel is
    broken then, and every later broadcast fails at once without writing. The gloo group stays for what needs an
    answer from every rank (`minimum`)."""

    def __init__(self, group, rank: int, pipes: list[BinaryIO], timeout_s: float = COLLECTIVE_TIMEOUT.total_seconds()):
        """`pipes`: on rank 0 the write ends of the workers' pipes, in rank order; on any other rank the one read end
        from rank 0."""
        self.group, self.rank, self.pipes, self.timeout_s = group, rank, pipes, timeout_s
        self.sent = 0  # frames rank 0 sent to every worker, one a broadcast
        self.broken: BaseException | None = None  # on rank 0, what failed a send: the channel sends no more
        if rank == 0:
            for pipe in pipes:
                enlarge_pipe(pipe.fileno())
                os.set_blocking(pipe.fileno(), False)  # a full pipe is waited on in poll, which has a timeout

    def broadcast(self, obj=None):
        """Rank 0 sends `obj`; the others receive it. Returns the object on every rank."""
        if self.rank != 0:
            return read_frame(self.pipes[0])
        if self.broken is not None:
            raise RankFailure(f"the channel of plans broke at an earlier send: {self.broken}") from self.broken
        data = memoryview(frame(obj))
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                self.send(rank, pipe, data)
            except BaseException as error:  # an interrupt too may leave part of a frame in the pipe
                self.broken = error
                raise
        self.sent += 1
        return obj

    def send(self, rank: int, pipe: BinaryIO, data: memoryview) -> None:
        """`data` down rank `rank`'s pipe, waiting for room while the pipe is full, up to `timeout_s`."""
        try:
            fd = pipe.fileno()
            deadline = time.monotonic() + self.timeout_s
            written = 0
            while written < len(data):
                try:
                    written += os.write(fd, data[written:])
                except BlockingIOError:
                    if not wait_writable(fd, deadline):
                        raise RankFailure(f"tensor-parallel rank {rank} did not read its plan within "
                                          f"{self.timeout_s:g} s") from None
        except (BrokenPipeError, ValueError) as error:  # ValueError: the pipe was closed on this side
            raise RuntimeError(f"tensor-parallel rank {rank} no longer reads its plans ({error})") from error

    def minimum(self, value: int) -> int:
        """The smallest of every rank's value."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tensor = torch.tensor([value], dtype=torch.int64)
        self.group.allreduce([tensor], options).wait()
        return int(tensor)


# What each pipe of plans asks to hold (Linux gives a pipe 64 KiB): a frame that fits the pipe's free space is sent
# without waiting for the worker, and a long prefill's plan outgrows 64 KiB (batch 64's decode step at 4k-token
# contexts comes near it: docs/performance.md).
PIPE_BYTES = 1 << 20


def enlarge_pipe(fd: int) -> None:
    """Ask the pipe to hold PIPE_BYTES. Where the system allows less (over /proc/sys/fs/pipe-max-size, or past the
    user's share of pipe buffers), the pipe keeps the size it has."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except PermissionError:
        pass


def wait_writable(fd: int, deadline: float) -> bool:
    """Wait until the pipe has room, or its reader has gone (the next write then fails at once), up to the
    `deadline` (time.monotonic()). False when the deadline passed first."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    left = deadline - time.monotonic()
    return left > 0 and bool(poller.poll(left * 1e3))


FRAME_HEADER = struct.Struct("<Q")  # a frame's size in bytes


def frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(data)) + data


def read_frame(pipe: BinaryIO):
    """The next object from rank 0's pipe. EOFError when rank 0 closed it, or exited, mid-frame or between frames."""
    header = read_exactly(pipe, FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        raise EOFError("rank 0 closed the pipe of plans")
    (size,) = FRAME_HEADER.unpack(header)
    data = read_exactly(pipe, size)
    if len(data) < size:
        raise EOFError(f"rank 0 closed the pipe of plans {len(data)} bytes into a frame of {size}")
    return pickle.loads(data)


def read_exactly(pipe: BinaryIO, size: int) -> memoryview:
    """`size` bytes from `pipe`, or fewer where it ends first. An unbuffered pipe's read returns what the pipe holds,
    which may be part of a frame: the reads go on until the frame is whole."""
    data = memoryview(bytearray(size))
    got = 0
    while got < size and (n := pipe.readinto(data[got:])):
        got += n
    return data[:got]


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process reads from its stdin at start."""

    config: Config  # as the engine was given it; the resolved copy follows over the channel
    rank: int
    size: int
    port: int  # of rank 0's store
    device: str  # rank 0's device
    threads: int  # the rank's intra-op threads


def rank_threads(size: int) -> int:
    """Intra-op threads for each of `size` ranks: OMP_NUM_THREADS when it is set, else an equal share of the cores
    this process may run on."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, len(os.sched_getaffinity(0)) // size)


class WorkerGroup:
    """Rank 0's side: starts the workers, forms the groups, and speaks for the workers to the engine."""

    def __init__(self, config: Config, device: torch.device):
        size = config.tensor_parallel_size
        if device.type == "cuda" and device.index + size > torch.cuda.device_count():
            raise ValueError(f"config field 'tensor_parallel_size' is {size}: ranks on {device} onwards need GPUs "
                             f"up to cuda:{device.index + size - 1}, and this machine has "
                             f"{torch.cuda.device_count()}")
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        threads = rank_threads(size)
        self.processes: list[subprocess.Popen] = []
        self._closer = weakref.finalize(self, stop_processes, self.processes)
        for rank in range(1, size):
            try:
                process = subprocess.Popen([python_executable(), "-c",
                                            "from diffulex_backend.workers import main; main()"],
                                           stdin=subprocess.PIPE, env=env)
                self.processes.append(process)
                # The pipe stays open: the worker's plans follow its setup down it (Channel).
                process.stdin.write(frame(WorkerSetup(config, rank, size, self.store.port, str(device), threads)))
                process.stdin.flush()
            except BaseException:
                self._closer()
                raise
        # This process is rank 0: its pool shrinks to its share while the engine runs, and close() gives it back.
        self.process_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        # Whether every rank waits for the next plan: then close() may tell them to stop. After any failure a rank
        # may sit in another collective than rank 0's, and only killing it cannot hang.
        self.in_step = False
        try:
            control, self.tp = self.call(connect, self.store, 0, size, rank_device(device, 0), config.expert_parallel)
        except BaseException:
            self.close()
            raise
        self.channel = Channel(control, 0, [process.stdin for process in self.processes])

    def call(self, fn, *args):
        """fn(*args) where a collective takes part: its failure (a RuntimeError from the backend) raised as the
        RankFailure of the rank that caused it. This rank's own errors (a bad setting) pass as they are."""
        try:
            return fn(*args)
        except RankFailure:
            raise
        except RuntimeError as error:
            failure = self.failure()
            if failure is None:
                raise
            raise RankFailure(failure) from error

    def failure(self) -> str | None:
        """What went wrong on a worker, if anything did: its own error message, else its exit status. Gives a
        dying worker a moment to finish exiting."""
        deadline = time.monotonic() + 5
        while True:
            for rank, process in enumerate(self.processes, start=1):
                key = FAILURE_KEY.format(rank)
                if self.store.check([key]):
                    return f"tensor-parallel rank {rank} failed: {self.store.get(key).decode()}"
                if process.poll() is not None:
                    status = exit_status(process.returncode)
                    return f"tensor-parallel rank {rank} (pid {process.pid}) exited with {status}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise RankFailure(self.failure() or f"tensor-parallel rank {rank} exited")

    def close(self) -> None:
        """Stop the workers: when each waits for a plan, told to leave their loop and given STOP_TIMEOUT_S to exit;
        whatever still runs then is killed."""
        if self.in_step and all(p.poll() is None for p in self.processes):
            self.in_step = False
            try:
                # Every rank waits for a plan: no kernel reads the other ranks' buffers any more. After a failure
                # one may, and letting go of its memory would wait for it: the buffers go with the process then.
                if self.tp.peer is not None:
                    self.tp.peer.close()
                self.channel.broadcast(None)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                for process in self.processes:
                    process.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass  # a rank gone or too slow: killed below
        self._closer()
        torch.set_num_threads(self.process_threads)


class BroadcastRunner:
    """Rank 0's runner under tensor parallelism: each plan, broadcast to every rank in its wire form, runs there and
    here. A plan carries the ids whose state the runners forget (SchedulerOutput.released), so every rank forgets
    them alike."""

    def __init__(self, runner, workers: WorkerGroup):
        self.runner, self.workers = runner, workers
        self.wire = PlanWire()

    def execute(self, sched):
        self.workers.check_alive()
        workers = self.workers
        workers.in_step = False  # until this step ends on every rank
        workers.call(workers.channel.broadcast, self.wire.encode(sched))
        result = workers.call(self.runner.execute, sched)
        workers.in_step = True
        return result


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """Kill what still runs, reap every process, and close the pipes. Also the finalizer of a group dropped without
    close(). The pipes close last: a worker that found its pipe ended before the kill reached it would fail with an
    EOFError, and print its traceback, in an ordinary shutdown."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()
        try:
            process.stdin.close()
        except OSError:
            pass  # a worker gone before it took its setup: the file still buffers the setup, and its flush fails


def exit_status(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def python_executable() -> str:
    # Inside Triton's Python backend sys.executable is the stub, not an interpreter; the stub finds its packages
    # through the python3 on PATH, which is the interpreter to use.
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


# ---- the worker process --------------------------------------------------------------------------------------

def watch_parent() -> None:
    """Exit when rank 0's process is gone, even while blocked in a collective that would wait for it."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(setup: WorkerSetup, store, plans: BinaryIO) -> None:
    torch.set_num_threads(setup.threads)
    device = rank_device(torch.device(setup.device), setup.rank)
    control, tp = connect(store, setup.rank, setup.size, device, setup.config.expert_parallel)
    channel = Channel(control, setup.rank, [plans])
    dtype = resolve_dtype(setup.config.dtype, device)
    model, _ = load_rank_model(setup.config, device, dtype, tp)
    config: Config = channel.broadcast()  # resolved from the checkpoint and tokenizer by rank 0
    runner, _ = build_runner(config, model, device, dtype, channel)
    wire = PlanWire()
    while (message := channel.broadcast()) is not None:
        runner.execute(wire.decode(message))
    if tp.peer is not None:
        tp.peer.close()


def plans_pipe() -> BinaryIO:
    """The pipe from rank 0 (it came as stdin), on a descriptor of its own that no child process inherits; stdin
    becomes /dev/null. A program the worker starts (a compiler, a tool) then neither holds the pipe open nor reads a
    plan from it. Unbuffered: read_frame reads each frame into a buffer of the frame's size, and no bytes wait in
    another buffer between frames."""
    plans = os.fdopen(os.dup(0), "rb", buffering=0)  # os.dup: not inheritable
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return plans


def main() -> None:
    plans = plans_pipe()
    setup: WorkerSetup = read_frame(plans)
    watch_parent()
    store = dist.TCPStore("127.0.0.1", setup.port, None, False, timeout=COLLECTIVE_TIMEOUT)
    try:
        with torch.inference_mode():
            serve(setup, store, plans)
    except BaseException as error:
        message = f"{type(error).__name__}: {error}"
        try:
            store.set(FAILURE_KEY.format(setup.rank), message)
        except Exception:
            pass  # rank 0 is gone: nobody to tell
        traceback.print_exc()
        sys.exit(1)


