"""The response thread's requests, from the engine taking one to its final response: each one's stream, its text
(an incremental detokenizer that also matches its stop strings), its metrics, and its cancellation polls.

The decoding thread hands over token ids only, so the text is made here, off the thread that drives the device. A
stop string that matches ends the request's stream at once, with the tokens through the match, and aborts the
request in the engine. The decoding thread takes the abort between two steps, so the request runs one step more
when this thread keeps up with it, more when it trails; those steps' tokens find no open request and are not sent.
A request the engine could not decode (its logits were not finite) ends with INTERNAL and the engine's words.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..output import Detokenizer, StepOutput
from .metrics import ServingMetrics
from .streams import ErrorKind, FailureCause, ResponseStream

if TYPE_CHECKING:
    from ..output import RequestDelta
    from ..resolve import StopRule

logger = logging.getLogger(__name__)

# Open requests polled for cancellation per tick of the response thread: each poll is a round trip to the server
# process (docs/performance.md, "Served against in-process", has the counts).
CANCEL_POLLS_PER_TICK = 8


@dataclass
class OpenRequest:
    """The response thread's record of a request the engine holds."""

    stream: ResponseStream
    arrival_time: float
    text: Detokenizer
    cancelling: bool = False  # the client cancelled; an abort is on its way to the engine
    counted_prompt: bool = False
    got_first_token: bool = False


class OpenRequests:
    """The requests the response thread still owes a final response, by request id. `abort` asks the decoding
    thread to drop a request from the engine; `end_with_error` sends an error as a stream's final response and
    counts it."""

    def __init__(self, metrics: ServingMetrics, tokenizer, abort: Callable[[str], None],
                 end_with_error: Callable[..., None]):
        self._metrics = metrics
        self._tokenizer = tokenizer
        self._abort = abort
        self._end_with_error = end_with_error
        self._requests: dict[str, OpenRequest] = {}
        self._next_cancel_poll = 0  # where the next round of cancellation polls starts

    def __len__(self) -> int:
        return len(self._requests)

    def streams(self) -> dict[str, ResponseStream]:
        return {request_id: request.stream for request_id, request in self._requests.items()}

    def open(self, request_id: str, stream: ResponseStream, arrival_time: float, stop: StopRule) -> None:
        text = Detokenizer(self._tokenizer, list(stop.strings), stop.min_tokens)
        self._requests[request_id] = OpenRequest(stream, arrival_time, text)

    def aborted(self, request_id: str) -> None:
        """The engine dropped the request on a cancellation: it ends CANCELLED, unless its stream has ended."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._end_with_error(request.stream, ErrorKind.CANCELLED, "the request was cancelled")

    def end_all(self, kind: ErrorKind, message: str, cause: FailureCause | None = None,
                abort: bool = False) -> None:
        """Every open request ends with this error, and with `abort` is dropped from the engine too."""
        for request_id, request in self._drain():
            if abort:
                self._abort(request_id)
            self._end_with_error(request.stream, kind, message, cause)

    def deliver(self, delta: RequestDelta, now: float) -> int:
        """Make the delta's text and send what it is due; returns the generated tokens it delivered."""
        request = self._requests.get(delta.request_id)
        if request is None:
            return 0
        if request.cancelling:
            if delta.finish_reason is not None:  # it finished before the abort arrived: no Aborted event comes
                del self._requests[delta.request_id]
                self._end_with_error(request.stream, ErrorKind.CANCELLED, "the request was cancelled")
            return 0
        if delta.error is not None:  # the engine could not decode it, and has freed its pages
            del self._requests[delta.request_id]
            logger.error("request %s failed: %s", delta.request_id, delta.error)
            self._end_with_error(request.stream, ErrorKind.INTERNAL, delta.error)
            return 0
        try:
            output = self._with_text(request, delta)
        except Exception as err:
            logger.exception("making the text of a response failed")
            self._fail(delta.request_id, err)
            return 0
        try:
            self._observe(request, output, now)
        except Exception:
            logger.exception("updating metrics failed")
        try:
            request.stream.send_output(output)
        except Exception as err:
            logger.exception("sending a response failed")
            self._fail(delta.request_id, err)
            return 0
        if output.finished:
            del self._requests[delta.request_id]
        return len(output.token_ids)

    def poll_cancellations(self, is_cancelled: Callable[[ResponseStream], bool]) -> None:
        """Poll the next CANCEL_POLLS_PER_TICK open requests, in turn, rather than every open request every tick,
        which would cost a step's worth of round trips at a large batch. A cancelled request is still noticed
        within (open requests / CANCEL_POLLS_PER_TICK) ticks."""
        ids = list(self._requests)
        if not ids:
            return
        start = self._next_cancel_poll % len(ids)
        for request_id in (ids[start:] + ids[:start])[:CANCEL_POLLS_PER_TICK]:
            request = self._requests[request_id]
            if not request.cancelling and is_cancelled(request.stream):
                request.cancelling = True
                self._abort(request_id)
        self._next_cancel_poll = start + CANCEL_POLLS_PER_TICK

    def _with_text(self, request: OpenRequest, delta: RequestDelta) -> StepOutput:
        """The delta with its text; a stop string that matches ends it at the tokens through the match, and aborts
        the request in the engine unless this step already finished it."""
        text, keep = request.text.add(delta.token_ids, final=delta.finish_reason is not None)
        if keep is None:
            return StepOutput.of(delta, text)
        if delta.finish_reason is None:
            self._abort(delta.request_id)  # frees its pages; its Aborted event finds no open request
        return StepOutput.of(delta.cut(keep), text)

    def _fail(self, request_id: str, err: Exception) -> None:
        """One request's response could not be made or sent: it ends with INTERNAL, and the engine drops it."""
        request = self._requests.pop(request_id)
        self._abort(request_id)  # free its pages
        self._end_with_error(request.stream, ErrorKind.INTERNAL,
                             f"building the response failed: {type(err).__name__}: {err}")

    def _observe(self, request: OpenRequest, output: StepOutput, now: float) -> None:
        metrics = self._metrics
        if not request.counted_prompt:
            request.counted_prompt = True
            metrics.prompt_tokens.increment(output.num_prompt_tokens)
        if output.token_ids:
            if not request.got_first_token:
                request.got_first_token = True
                metrics.time_to_first_token.observe(now - request.arrival_time)
        if output.finished:
            metrics.request_latency.observe(now - request.arrival_time)
            if output.nfe:
                metrics.tokens_per_forward.observe(output.num_output_tokens / output.nfe)

    def _drain(self) -> Iterator[tuple[str, OpenRequest]]:
        requests, self._requests = self._requests, {}
        return iter(requests.items())
