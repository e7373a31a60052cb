"""The engine on a decoding thread of its own, and the responses on a second thread.

The engine is not thread-safe, so exactly one thread touches it: the decoding thread takes commands
(submit, abort, stop) from a queue between steps and runs `engine.step_deltas()` while any request is
unfinished. Everything it learns goes onto an event queue, in order. The response thread turns events into
responses, so a slow send never stalls decoding; it also polls every open request for cancellation and
updates the metrics, because each of those is a round trip to the server process.

The text is made on the response thread too (open_requests.py): the engine hands over token ids, and each
request's incremental detokenizer turns them into text and matches its stop strings there, off the thread that
drives the device.

Requests arrive prepared (engine.prepare_request, on Triton's thread), so what could fail for one request alone
has been checked. A request that cannot join the engine, whose logits turn out not finite (the engine ends it), or
whose response cannot be built or sent, ends with an INTERNAL error and leaves the engine; the others carry on. An
exception from `engine.step_deltas()` cannot be pinned on one request: it fails the loop, every open request ends
with an INTERNAL error, new requests are refused with UNAVAILABLE, and `on_failure` is told (the model's watchdog
then reloads it). While requests are open, the response thread also asks `server_is_leaving` twice a second: once the
server shuts down or unloads the model, every open request ends with UNAVAILABLE at once instead of being cut off.

A thread that ends without being told to (an exception in its set-up, an error that escapes its loop) fails the
loop the same way, with the cause `THREAD_DEATH`: a model whose threads are gone must never look ready. Whichever
thread is left answers every request the other one held; when the response thread is the one that ended, the
decoding thread answers them and stops.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..profiling import step_range
from .metrics import ServingMetrics
from .open_requests import OpenRequests
from .streams import ErrorKind, FailureCause, ResponseStream

if TYPE_CHECKING:
    from .. import Diffulex, EngineMetrics
    from ..output import RequestDelta
    from ..resolve import ResolvedRequest, StopRule

logger = logging.getLogger(__name__)

LEAVING_MESSAGE = "the server is shutting down or unloading this model"


# The error counter's cause for an error that no failure of the loop explains (metrics.ERROR_CAUSES).
ERROR_CAUSE_OF_KIND = {ErrorKind.INVALID_ARG: "refused", ErrorKind.CANCELLED: "cancelled",
                       ErrorKind.INTERNAL: "internal", ErrorKind.UNAVAILABLE: "unavailable"}


class LoopState(enum.Enum):
    RUNNING = enum.auto()
    LEAVING = enum.auto()  # the server is shutting down or unloading the model: open requests were ended
    FAILED = enum.auto()  # the engine or one of the loop's threads failed; nothing more is decoded
    STOPPED = enum.auto()


# Commands, to the decoding thread.
@dataclass(frozen=True)
class Submit:
    request_id: str
    prepared: ResolvedRequest
    stream: ResponseStream
    arrival_time: float


@dataclass(frozen=True)
class Abort:
    request_id: str


class Stop:
    pass


@dataclass(frozen=True)
class Halt:
    """From the response thread as it ends: the decoding thread answers the requests it held, then stops."""

    open_streams: dict[str, ResponseStream]


# Events, to the response thread, in the order the decoding thread saw things happen.
@dataclass(frozen=True)
class Opened:
    request_id: str
    stream: ResponseStream
    arrival_time: float
    stop: StopRule  # the stop strings and min_tokens the response thread matches in the text
    snapshot: EngineMetrics


@dataclass(frozen=True)
class Rejected:
    stream: ResponseStream
    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class Stepped:
    deltas: list[RequestDelta]
    snapshot: EngineMetrics
    time: float


@dataclass(frozen=True)
class Aborted:
    request_id: str
    snapshot: EngineMetrics


@dataclass(frozen=True)
class Failed:
    cause: FailureCause
    message: str  # what the clients are told


class Stopped:
    pass


class EngineLoop:
    def __init__(self, engine: Diffulex, metrics: ServingMetrics, *, cancel_poll_interval_s: float = 0.02,
                 on_failure: Callable[[FailureCause, str], None] = lambda cause, message: None,
                 server_is_leaving: Callable[[], bool] = lambda: False, server_check_interval_s: float = 0.5):
        self._engine = engine
        self._metrics = metrics
        self._cancel_poll_interval_s = cancel_poll_interval_s
        self._on_failure = on_failure
        self._server_is_leaving = server_is_leaving  # asked while requests are open (server_watch.py)
        self._server_check_interval_s = server_check_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        # Guards the state against submits racing a failure or a stop, so no Submit is left unanswered in
        # a queue that nobody reads any more.
        self._lock = threading.Lock()
        self._state = LoopState.RUNNING
        self._failure = ""
        # Which threads have ended (under the lock): the one that ends last answers what the other one held.
        self._decoding_ended = self._responses_ended = False
        self._request_ids = itertools.count()
        self._decoding_thread = threading.Thread(target=self._run_decoding, name="diffulex-decoding", daemon=True)
        self._response_thread = threading.Thread(target=self._run_responses, name="diffulex-responses", daemon=True)
        self._set_up = threading.Event()
        self._decoding_thread.start()
        self._response_thread.start()
        self._set_up.wait()
        if self._state is LoopState.FAILED:  # the decoding thread could not set itself up: nothing can be served
            self._events.put(Stopped())
            self._response_thread.join()
            raise RuntimeError(self._failure)

    @property
    def state(self) -> LoopState:
        return self._state

    def submit(self, prepared: ResolvedRequest, stream: ResponseStream) -> None:
        """Hand a request the engine has prepared (engine.prepare_request) to the decoding thread."""
        with self._lock:
            if self._state is LoopState.RUNNING:
                request_id = f"diffulex-{next(self._request_ids)}"
                self._commands.put(Submit(request_id, prepared, stream, time.monotonic()))
                return
            message = self._refusal()
        self._end_with_error(stream, ErrorKind.UNAVAILABLE, message)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End both threads; requests still open end with UNAVAILABLE once the step under way has ended. A step
        that outlasts `timeout_s` is left to finish on its (daemon) thread: the server must not wait on it."""
        with self._lock:
            if self._state in (LoopState.RUNNING, LoopState.LEAVING):
                self._state = LoopState.STOPPED
                self._commands.put(Stop())  # the decoding thread answers with Stopped
            else:
                self._events.put(Stopped())  # the decoding thread has already ended
        deadline = time.monotonic() + timeout_s
        self._decoding_thread.join(timeout_s)
        self._response_thread.join(max(0.0, deadline - time.monotonic()))

    def _refusal(self) -> str:
        if self._state is LoopState.FAILED:
            return self._failure
        if self._state is LoopState.LEAVING:
            return LEAVING_MESSAGE
        return "the model is being unloaded"

    # ---- decoding thread ----------------------------------------------------------------------------------
    def _run_decoding(self) -> None:
        """The decoding thread, set-up included: any way out but a Stop or a Halt fails the loop."""
        live: dict[str, ResponseStream] = {}  # the requests the engine holds, and where they are answered
        try:
            self._enter_device()
        except BaseException as err:  # noqa: BLE001 (the constructor raises it, and the model does not load)
            logger.critical("the decoding thread could not start", exc_info=True)
            with self._lock:
                self._state = LoopState.FAILED
                self._failure = f"the decoding thread could not start: {type(err).__name__}: {err}"
            self._set_up.set()
            return
        self._set_up.set()
        try:
            self._decode(live)
            return
        except BaseException as err:  # noqa: BLE001 (whatever ends this thread must not leave requests waiting)
            logger.critical("the decoding thread stopped", exc_info=True)
            cause = f"{type(err).__name__}: {err}"
        self._fail(FailureCause.THREAD_DEATH,
                   f"the decoding thread stopped and this model can no longer serve: {cause}", live)

    def _enter_device(self) -> None:
        device = self._engine.device
        if device.type == "cuda":
            # A new thread's current device is GPU 0; the Triton kernels launch on the current one.
            torch.cuda.set_device(device)

    def _decode(self, live: dict[str, ResponseStream]) -> None:
        try:
            while True:
                for command in self._next_commands(block=not self._engine.has_unfinished_requests()):
                    if isinstance(command, Stop):
                        self._events.put(Stopped())
                        return
                    if isinstance(command, Halt):
                        self._answer_all({**live, **command.open_streams}, FailureCause.THREAD_DEATH)
                        return
                    self._apply(command, live)
                if self._engine.has_unfinished_requests():
                    deltas = self._engine.step_deltas()
                    for delta in deltas:
                        if delta.finish_reason is not None:
                            live.pop(delta.request_id, None)
                    self._events.put(Stepped(deltas, self._engine.metrics(), time.monotonic()))
        except Exception as err:  # the engine's state is unknown now: stop decoding rather than guess
            logger.exception("the engine failed")
            self._fail(FailureCause.ENGINE,
                       f"the engine failed and this model can no longer serve: {type(err).__name__}: {err}", live)

    def _next_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command, live: dict[str, ResponseStream]) -> None:
        if isinstance(command, Submit):
            try:
                self._engine.add_request(command.prepared, request_id=command.request_id)
            except Exception as err:  # refused alone: the engine's state is untouched
                logger.exception("add_request failed")
                self._events.put(Rejected(command.stream, ErrorKind.INTERNAL, f"{type(err).__name__}: {err}"))
                return
            live[command.request_id] = command.stream
            self._events.put(Opened(command.request_id, command.stream, command.arrival_time, command.prepared.stop,
                                    self._engine.metrics()))
        elif isinstance(command, Abort) and command.request_id in live:
            self._engine.abort(command.request_id)
            del live[command.request_id]
            self._events.put(Aborted(command.request_id, self._engine.metrics()))

    def _fail(self, cause: FailureCause, message: str, live: dict[str, ResponseStream]) -> None:
        """On the decoding thread, as it ends: refuse what is queued for it, and tell the response thread, or answer
        everything here when that thread has ended too."""
        with self._lock:
            self._failure = message
            if self._state in (LoopState.RUNNING, LoopState.LEAVING):
                self._state = LoopState.FAILED
            self._decoding_ended = True
            answer_here = self._responses_ended
            if not answer_here:
                refusal = self._refusal()
                self._events.put(Failed(cause, message))
                for command in self._next_commands(block=False):
                    if isinstance(command, Submit):
                        self._events.put(Rejected(command.stream, ErrorKind.UNAVAILABLE, refusal))
                    elif isinstance(command, Stop):
                        self._events.put(Stopped())
        if answer_here:
            self._answer_all(live, cause)
            self._report_failure(cause, message)

    def _answer_all(self, open_streams: dict[str, ResponseStream], cause: FailureCause) -> None:
        """Answer every request still owed a final response, when the thread that would have answered it has ended:
        `open_streams`, the requests in events that were never read, and those queued for the decoding thread. The
        loop is FAILED by then, so nothing new is queued."""
        streams = dict(open_streams)
        rejected = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, Opened):
                streams[event.request_id] = event.stream
            elif isinstance(event, Rejected):
                rejected.append(event)
        for command in self._next_commands(block=False):
            if isinstance(command, Submit):
                streams[command.request_id] = command.stream
            elif isinstance(command, Halt):
                streams.update(command.open_streams)
        for event in rejected:
            self._end_with_error(event.stream, event.kind, event.message)
        for stream in streams.values():
            self._end_with_error(stream, ErrorKind.INTERNAL, self._failure, cause)

    # ---- response thread ----------------------------------------------------------------------------------
    def _run_responses(self) -> None:
        """The response thread: any way out but a Stopped event fails the loop, and the decoding thread answers the
        requests this one held."""
        open_requests = OpenRequests(self._metrics, self._engine.tokenizer, lambda request_id:
                                     self._commands.put(Abort(request_id)), self._end_with_error)
        try:
            self._respond(open_requests)
            return
        except BaseException as err:  # noqa: BLE001 (whatever ends this thread must not leave requests waiting)
            logger.critical("the response thread stopped", exc_info=True)
            cause = f"{type(err).__name__}: {err}"
        message = f"the response thread stopped and this model can no longer serve: {cause}"
        open_streams = open_requests.streams()
        with self._lock:
            self._failure = message
            if self._state in (LoopState.RUNNING, LoopState.LEAVING):
                self._state = LoopState.FAILED
            self._responses_ended = True
            answer_here = self._decoding_ended
            if not answer_here:
                self._commands.put(Halt(open_streams))
        if answer_here:
            self._answer_all(open_streams, FailureCause.THREAD_DEATH)
        self._report_failure(FailureCause.THREAD_DEATH, message)

    def _respond(self, open_requests: OpenRequests) -> None:
        next_poll = time.monotonic() + self._cancel_poll_interval_s
        next_server_check = time.monotonic() + self._server_check_interval_s
        while True:
            # With nothing open there is nothing to poll: wait for the next event without waking up.
            timeout = max(0.0, next_poll - time.monotonic()) if open_requests else None
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = None
            if isinstance(event, Stopped):
                open_requests.end_all(ErrorKind.UNAVAILABLE, "the model is being unloaded")
                return
            try:  # whatever goes wrong with one event, this thread must live on to answer the others
                if event is not None:
                    self._handle(event, open_requests)
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + self._cancel_poll_interval_s
                    open_requests.poll_cancellations(_is_cancelled)
                if open_requests and time.monotonic() >= next_server_check:
                    next_server_check = time.monotonic() + self._server_check_interval_s
                    if self._server_is_leaving():
                        self._leave(open_requests)
            except Exception:
                logger.exception("handling %r failed", event)

    def _handle(self, event, open_requests: OpenRequests) -> None:
        if isinstance(event, Stepped):
            self._metrics.update_engine(event.snapshot)
            with step_range("respond", self._engine.device):
                generated = sum(open_requests.deliver(delta, event.time) for delta in event.deltas)
            if generated:  # one increment a step, not one per request: each is a round trip to the server
                self._metrics.generation_tokens.increment(generated)
        elif isinstance(event, Opened):
            open_requests.open(event.request_id, event.stream, event.arrival_time, event.stop)
            self._metrics.update_engine(event.snapshot)
        elif isinstance(event, Aborted):
            self._metrics.update_engine(event.snapshot)
            open_requests.aborted(event.request_id)
        elif isinstance(event, Rejected):
            self._end_with_error(event.stream, event.kind, event.message)
        elif isinstance(event, Failed):
            open_requests.end_all(ErrorKind.INTERNAL, event.message, event.cause)
            self._report_failure(event.cause, event.message)

    def _end_with_error(self, stream: ResponseStream, kind: ErrorKind, message: str,
                        cause: FailureCause | None = None) -> None:
        """Send the error as the stream's final response, and count it under its cause."""
        _send_error(stream, kind, message)
        try:
            self._metrics.count_errors(cause.value if cause is not None else ERROR_CAUSE_OF_KIND[kind])
        except Exception:
            logger.exception("counting an error failed")

    def _report_failure(self, cause: FailureCause, message: str) -> None:
        try:
            self._on_failure(cause, message)
        except Exception:
            logger.exception("reporting the failure failed")

    def _leave(self, open_requests: OpenRequests) -> None:
        """The server is going away: end every open request now, rather than let it be cut off mid-stream, and
        refuse new ones; their pages are freed by the aborts."""
        with self._lock:
            if self._state is LoopState.RUNNING:
                self._state = LoopState.LEAVING
        logger.warning("the server is shutting down or unloading the model: ending %d open requests",
                       len(open_requests))
        open_requests.end_all(ErrorKind.UNAVAILABLE, LEAVING_MESSAGE, abort=True)


def _is_cancelled(stream: ResponseStream) -> bool:
    try:
        return stream.is_cancelled()
    except Exception:
        logger.exception("polling for cancellation failed")
        return False


def _send_error(stream: ResponseStream, kind: ErrorKind, message: str) -> None:
    try:
        stream.send_error(kind, message)
    except Exception:  # the client may be gone; nothing else is owed to it
        logger.exception("sending an error response failed")
