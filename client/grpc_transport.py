"""One request over gRPC: the model is decoupled, so even a non-streamed request travels on a stream.

Each request gets a stream (and a tritonclient client) of its own: a tritonclient client holds at most one
stream, and a stream per request lets several threads or tasks generate at once. Closing the responses
before the final one cancels the request, which the server turns into an abort that frees its KV pages.
"""

from __future__ import annotations

import asyncio
import queue

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from .errors import DiffulexServerError, from_rpc_error, from_triton_exception
from .messages import OUTPUT_NAMES, GenerateRequest, ModelResponse

FINAL_FLAG = "triton_final_response"  # set on every response when the request enables empty final responses


def requested_outputs() -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput(name) for name in OUTPUT_NAMES]


def read_response(result) -> ModelResponse:
    """Decode one response; a final one without a finish reason breaks the model's contract."""
    response = ModelResponse.from_grpc(result)
    flags = result.get_response().parameters
    if FINAL_FLAG in flags and flags[FINAL_FLAG].bool_param and not response.is_final:
        raise DiffulexServerError("the server ended the request without a finish_reason")
    return response


class GrpcResponses:
    """An iterator of a request's ModelResponses that ends after the final one."""

    def __init__(self, url: str, model: str, request: GenerateRequest, timeout: float | None):
        self._client = grpcclient.InferenceServerClient(url)
        # (InferResult, None) or (None, InferenceServerException), put by tritonclient's stream thread.
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()
        self._request_ended = False  # the final response or an error came: nothing is left to cancel
        self._closed = False
        try:
            self._client.start_stream(callback=lambda result, error: self._arrivals.put((result, error)),
                                      stream_timeout=timeout)
            self._client.async_stream_infer(model, request.grpc_inputs(), outputs=requested_outputs(),
                                            enable_empty_final_response=True)
        except InferenceServerException as err:
            self.close()  # joins tritonclient's stream thread, so an error it saw is in the queue by now
            reported = None if self._arrivals.empty() else self._arrivals.get()[1]
            raise from_triton_exception(reported or err) from None

    def __iter__(self) -> GrpcResponses:
        return self

    def __next__(self) -> ModelResponse:
        if self._closed:
            raise StopIteration
        result, error = self._arrivals.get()
        try:
            if error is not None:
                self._request_ended = True
                raise from_triton_exception(error) from None
            response = read_response(result)
        except BaseException:
            self.close()
            raise
        if response.is_final:
            self._request_ended = True
            self.close()
        return response

    def close(self) -> None:
        """Cancel the request on the server unless it has ended; idempotent.

        An ended request's stream is half-closed instead, and the server ends it: cancelling a stream
        right after its final response can leave that response unreleased in Triton 2.51, and the server
        then never unloads the model."""
        if not self._closed:
            self._closed = True
            self._client.stop_stream(cancel_requests=not self._request_ended)
            self._client.close()

    def __del__(self):
        if hasattr(self, "_closed"):  # not when __init__ failed before it got that far
            self.close()


class AsyncGrpcResponses:
    """The asyncio counterpart of GrpcResponses."""

    def __init__(self, url: str, model: str, request: GenerateRequest, timeout: float | None):
        self._client = grpcclient_aio.InferenceServerClient(url)
        self._request_ended = False
        self._closed = False
        self._half_close = asyncio.Event()

        async def one_request():
            yield {"model_name": model, "inputs": request.grpc_inputs(), "outputs": requested_outputs(),
                   "parameters": {"triton_enable_empty_final_response": True}}
            # Keep our side of the stream open, as the synchronous client does: a request cancelled after
            # the client half-closed its stream is aborted, but Triton 2.51 then never unloads the model.
            await self._half_close.wait()

        self._call = self._client.stream_infer(one_request(), stream_timeout=timeout)

    def __aiter__(self) -> AsyncGrpcResponses:
        return self

    async def __anext__(self) -> ModelResponse:
        if self._closed:
            raise StopAsyncIteration
        try:
            try:
                result, error = await self._call.__anext__()
            except grpc.RpcError as err:
                self._request_ended = True
                raise from_rpc_error(err) from None
            except StopAsyncIteration:
                self._request_ended = True
                raise DiffulexServerError("the server closed the stream before the final response") from None
            if error is not None:
                self._request_ended = True
                raise from_triton_exception(error) from None
            response = read_response(result)
        except BaseException:  # CancelledError too: the task that awaited us was cancelled
            await self.aclose()
            raise
        if response.is_final:
            self._request_ended = True
            await self.aclose()
        return response

    async def aclose(self) -> None:
        """Cancel the request on the server unless it has ended; idempotent. An ended request's stream
        is half-closed and left for the server to end, as in GrpcResponses.close."""
        if self._closed:
            return
        self._closed = True
        if not self._request_ended:
            self._call.cancel()
        self._half_close.set()
        if self._request_ended:
            await self._until_server_ends_call()
        await self._client.close()

    async def _until_server_ends_call(self) -> None:
        try:
            async for _ in self._call:  # nothing more is due: the server ends the call after the half-close
                pass
        except grpc.RpcError:  # it had already failed
            pass
