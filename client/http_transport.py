"""One request over HTTP, through Triton's generate extension.

tritonclient's HTTP clients cannot infer on a decoupled model and have no call for the generate
extension, so this posts to it directly, always to `/generate_stream`, which answers with server-sent
events (`data: {...}` lines), one per model response. Triton cancels a request whose connection has
closed when it next writes a response to it, so a request goes out streamed even when the caller wants
one completion: closing the connection then cancels it within one block. Not streamed, it would run to
its end.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import replace
from urllib.parse import quote

import aiohttp

from .errors import DiffulexConnectionError, DiffulexServerError, DiffulexTimeoutError, from_os_error
from .messages import GenerateRequest, ModelResponse

SSE_DATA = b"data:"
JSON_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


def endpoint(model: str) -> str:
    return f"/v2/models/{quote(model, safe='')}/generate_stream"


def streamed_body(request: GenerateRequest) -> dict:
    return replace(request, stream=True).generate_body()


def read_body(raw: bytes, status: int) -> ModelResponse:
    """Decode one event of the generate extension, raising the server's error if it is one."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise DiffulexServerError(raw.decode("utf-8", "replace").strip() or f"HTTP {status}", str(status)) from None
    if "error" in body:
        raise DiffulexServerError(body["error"], str(status))
    if status != 200:
        raise DiffulexServerError(f"HTTP {status}: {raw.decode('utf-8', 'replace')}", str(status))
    return ModelResponse.from_json(body)


def error_body(raw: bytes) -> bytes:
    """The JSON of an error answer: a model's error comes as one event, Triton's own (an unknown model's 404) as a
    plain JSON body."""
    raw = raw.strip()
    return raw[len(SSE_DATA):] if raw.startswith(SSE_DATA) else raw


def stream_ended_early() -> DiffulexServerError:
    return DiffulexServerError("the server closed the stream before the final response")


class HttpResponses:
    """An iterator of a request's ModelResponses that ends after the final one."""

    def __init__(self, url: str, model: str, request: GenerateRequest, timeout: float | None):
        self._url = url
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._ended = False
        self._connection = http.client.HTTPConnection(url, timeout=timeout)
        try:
            self._connection.request("POST", endpoint(model), body=json.dumps(streamed_body(request)),
                                     headers=JSON_HEADERS)
            self._response = self._connection.getresponse()
        except OSError as err:
            self.close()
            raise from_os_error(err, url) from None

    def __iter__(self) -> HttpResponses:
        return self

    def __next__(self) -> ModelResponse:
        if self._ended:
            raise StopIteration
        try:
            response = read_body(self._next_raw_body(), self._response.status)
        except BaseException:
            self.close()
            raise
        if response.is_final:
            self.close()
        return response

    def _next_raw_body(self) -> bytes:
        self._apply_deadline()
        try:
            if self._response.status != 200:
                return error_body(self._response.read())
            while line := self._response.readline():
                if line.startswith(SSE_DATA):
                    return line[len(SSE_DATA):]
                self._apply_deadline()
        except OSError as err:
            raise from_os_error(err, self._url) from None
        except http.client.HTTPException as err:
            raise DiffulexConnectionError(f"the connection to {self._url} broke: {err!r}") from None
        raise stream_ended_early()

    def _apply_deadline(self) -> None:
        """Bound the next socket read by what is left of the request's timeout."""
        if self._deadline is None:
            return
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DiffulexTimeoutError(f"no final answer from {self._url} within the timeout")
        if self._connection.sock is not None:
            self._connection.sock.settimeout(remaining)

    def close(self) -> None:
        """Close the connection, which cancels the request on the server unless it has ended; idempotent."""
        self._ended = True
        self._connection.close()

    def __del__(self):
        if hasattr(self, "_connection"):
            self.close()


class AsyncHttpResponses:
    """The asyncio counterpart of HttpResponses; the request is posted on the first `__anext__`."""

    def __init__(self, url: str, model: str, request: GenerateRequest, timeout: float | None):
        self._url = url
        self._model = model
        self._request = request
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._ended = False

    def __aiter__(self) -> AsyncHttpResponses:
        return self

    async def __anext__(self) -> ModelResponse:
        if self._ended:
            raise StopAsyncIteration
        try:
            try:
                response = read_body(await self._next_raw_body(), self._response.status)
            except OSError as err:  # aiohttp's connection errors, and TimeoutError
                raise from_os_error(err, self._url) from None
            except aiohttp.ClientError as err:
                raise DiffulexConnectionError(f"the connection to {self._url} broke: {err!r}") from None
        except BaseException:  # CancelledError too: the task that awaited us was cancelled
            await self.aclose()
            raise
        if response.is_final:
            await self.aclose()
        return response

    async def _next_raw_body(self) -> bytes:
        if self._response is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._response = await self._session.post(
                f"http://{self._url}{endpoint(self._model)}", json=streamed_body(self._request),
                headers=JSON_HEADERS)
        if self._response.status != 200:
            return error_body(await self._response.read())
        while line := await self._response.content.readline():
            if line.startswith(SSE_DATA):
                return line[len(SSE_DATA):]
        raise stream_ended_early()

    async def aclose(self) -> None:
        """Close the connection, which cancels the request on the server unless it has ended; idempotent."""
        self._ended = True
        if self._session is not None:
            await self._session.close()
            self._session = None
