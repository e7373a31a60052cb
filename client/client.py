"""DiffulexClient and AsyncDiffulexClient: generate or stream text from the diffulex model on Triton.

Sampling parameters are passed as keyword arguments (`max_tokens=64, temperature=0.7, seed=1, stop=[...]`)
and sent as the model's `sampling_parameters` JSON; the server validates them and names any bad one in
its error. `timeout` bounds each request from sending it to its final response (None waits forever).
"""

from __future__ import annotations

from .grpc_transport import AsyncGrpcResponses, GrpcResponses
from .health import ServerHealth, check_health
from .http_transport import AsyncHttpResponses, HttpResponses
from .messages import Completion, GenerateRequest
from .protocol import Protocol
from .streams import AsyncCompletionStream, CompletionStream

DEFAULT_MODEL = "diffulex"


class DiffulexClient:
    """Each call opens its own stream or connection, so one client may serve several threads."""

    def __init__(self, url: str | None = None, protocol: str | Protocol = "grpc", model: str = DEFAULT_MODEL,
                 timeout: float | None = None):
        self.protocol = Protocol(protocol)
        self.url = url or self.protocol.default_url  # host:port, without a scheme, as tritonclient takes it
        self.model = model
        self.timeout = timeout

    def generate(self, prompt: str, **sampling) -> Completion:
        """The whole completion in one response."""
        with self._open(GenerateRequest(prompt, sampling, stream=False)) as stream:
            for _ in stream:
                pass
            return stream.completion

    def stream(self, prompt: str, **sampling) -> CompletionStream:
        """Text deltas as the model commits blocks. Closing the stream early cancels the request."""
        return self._open(GenerateRequest(prompt, sampling, stream=True))

    def health(self, metrics_url: str | None = None) -> ServerHealth:
        """Readiness, the config.pbtxt settings, and each instance's resolved settings from Triton's metrics
        endpoint (`metrics_url`, default port 8002 of the server's host)."""
        return check_health(self.url, self.protocol, self.model, self.timeout, metrics_url)

    def _open(self, request: GenerateRequest) -> CompletionStream:
        transport = GrpcResponses if self.protocol is Protocol.GRPC else HttpResponses
        return CompletionStream(transport(self.url, self.model, request, self.timeout))


class AsyncDiffulexClient:
    """The asyncio client; each call opens its own stream or connection, so calls may run concurrently."""

    def __init__(self, url: str | None = None, protocol: str | Protocol = "grpc", model: str = DEFAULT_MODEL,
                 timeout: float | None = None):
        self.protocol = Protocol(protocol)
        self.url = url or self.protocol.default_url
        self.model = model
        self.timeout = timeout

    async def generate(self, prompt: str, **sampling) -> Completion:
        async with self._open(GenerateRequest(prompt, sampling, stream=False)) as stream:
            async for _ in stream:
                pass
            return stream.completion

    def stream(self, prompt: str, **sampling) -> AsyncCompletionStream:
        """`async for delta in client.stream(...)`; `await stream.aclose()` early cancels the request."""
        return self._open(GenerateRequest(prompt, sampling, stream=True))

    def _open(self, request: GenerateRequest) -> AsyncCompletionStream:
        transport = AsyncGrpcResponses if self.protocol is Protocol.GRPC else AsyncHttpResponses
        return AsyncCompletionStream(transport(self.url, self.model, request, self.timeout))
