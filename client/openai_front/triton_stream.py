"""The front's side of Triton's gRPC stream: one shared channel to tritonserver, one stream call per request.

A gRPC stream of Triton carries no status code with a model's error, only its message, so `classify_error` sorts
messages into the model refusing the request (400), the model or server being unavailable (503), and the rest
(500). A closed `TritonStream` that had not ended cancels its call, which the model turns into an abort that frees
the request's KV pages.
"""

from __future__ import annotations

import asyncio
import enum
import re
from collections.abc import Sequence

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio

from ..grpc_transport import FINAL_FLAG, requested_outputs
from ..messages import ModelResponse

# A server that comes back is found within a second: gRPC's default reconnect backoff grows to two minutes.
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
]

# How long an ended call may take to close after the half-close before it is cancelled.
DRAIN_TIMEOUT_S = 5.0


class ErrorClass(enum.Enum):
    BAD_REQUEST = "bad_request"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


# Words of the model's and Triton's errors that are not the request's fault: the model or server is going away.
UNAVAILABLE_MARKERS = ("the server is shutting down", "the model is being unloaded", "request for unknown model",
                       "the engine failed", "can no longer serve", "could not start", "stub process is not healthy",
                       "failed to connect", "is not ready", "model is unavailable")
# How the model's own faults on one request begin: preparing it, decoding it (logits not finite), answering it.
INTERNAL_MARKERS = ("preparing the request failed", "decoding failed", "building the response failed")
# How the model's refusals of a request's inputs, parameters and prompt begin (diffulex_backend.serving).
REQUEST_FAULTS = ("input '", "request parameters", "sampling parameter '", "prompt ", "request needs up to ")
# An exception's own text ("RuntimeError: ..."): something failed inside; the model's refusals are sentences.
EXCEPTION_TEXT = re.compile(r"^[A-Z]\w*(Error|Exception|Failure): ")


def classify_error(message: str) -> ErrorClass:
    if message.startswith(REQUEST_FAULTS):  # before the markers: such a refusal quotes the client's own values
        return ErrorClass.BAD_REQUEST
    lowered = message.lower()
    if any(marker in lowered for marker in UNAVAILABLE_MARKERS):
        return ErrorClass.UNAVAILABLE
    if any(lowered.startswith(marker) for marker in INTERNAL_MARKERS) or EXCEPTION_TEXT.match(message):
        return ErrorClass.INTERNAL
    return ErrorClass.BAD_REQUEST


class TritonStreamError(Exception):
    def __init__(self, message: str, kind: ErrorClass):
        super().__init__(message)
        self.message = message
        self.kind = kind


def open_channel(url: str) -> grpcclient_aio.InferenceServerClient:
    return grpcclient_aio.InferenceServerClient(url, channel_args=CHANNEL_ARGS)


class TritonStream:
    """The responses of one request, as ModelResponses, up to the final one."""

    def __init__(self, client: grpcclient_aio.InferenceServerClient, model: str,
                 inputs: Sequence[grpcclient.InferInput]):
        self._ended = False  # the final response or an error came: nothing is left to cancel
        self._closed = False
        self._half_close = asyncio.Event()

        async def one_request():
            yield {"model_name": model, "inputs": list(inputs), "outputs": requested_outputs(),
                   "parameters": {"triton_enable_empty_final_response": True}}
            # Our side stays open until the request ends: Triton 2.51 never unloads a model whose request was
            # cancelled after its client half-closed the stream.
            await self._half_close.wait()

        self._call = client.stream_infer(one_request())

    def __aiter__(self) -> TritonStream:
        return self

    async def __anext__(self) -> ModelResponse:
        if self._ended:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except grpc.RpcError as err:
            self._ended = True
            raise TritonStreamError(err.details() or str(err.code()), _rpc_error_class(err)) from None
        except StopAsyncIteration:
            self._ended = True
            raise TritonStreamError("tritonserver closed the stream before the final response",
                                    ErrorClass.UNAVAILABLE) from None
        if error is not None:
            self._ended = True
            raise TritonStreamError(error.message(), classify_error(error.message()))
        response = ModelResponse.from_grpc(result)
        flags = result.get_response().parameters
        if FINAL_FLAG in flags and flags[FINAL_FLAG].bool_param:
            self._ended = True
            if not response.is_final:
                raise TritonStreamError("the model ended the request without a finish_reason", ErrorClass.INTERNAL)
        return response

    def cancel_if_open(self) -> None:
        """Cancel the request unless it has ended, at once: a cancelled task may not get to await aclose."""
        if not self._ended and not self._closed:
            self._closed = True
            self._half_close.set()
            self._call.cancel()

    async def aclose(self) -> None:
        """Cancel the request unless it has ended, else wait for the server to end the call; idempotent."""
        if self._closed:
            return
        self.cancel_if_open()
        if self._closed:
            return
        self._closed = True
        self._half_close.set()
        try:  # nothing more is due: the server ends the call after the half-close
            await asyncio.wait_for(self._drain(), DRAIN_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._call.cancel()

    async def _drain(self) -> None:
        try:
            async for _ in self._call:
                pass
        except grpc.RpcError:
            pass


def _rpc_error_class(err: grpc.RpcError) -> ErrorClass:
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ErrorClass.UNAVAILABLE
    if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return ErrorClass.BAD_REQUEST
    return ErrorClass.INTERNAL
