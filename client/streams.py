"""What callers iterate: the text deltas of one request, and its Completion once the final response is in.

A stream wraps the ModelResponses of a transport. Closing it (or leaving its `with` block) before the
final response cancels the request on the server.
"""

from __future__ import annotations

from .messages import Completion, ModelResponse


class _Recorder:
    """Keeps the deltas seen so far, and builds the Completion from the final response."""

    def __init__(self, responses):
        self._responses = responses  # a transport's iterator (or async iterator) of ModelResponse
        self._texts: list[str] = []
        self.completion: Completion | None = None  # set once the final response is in

    def _record(self, response: ModelResponse) -> str:
        self._texts.append(response.text)
        if response.is_final:
            self.completion = Completion.from_responses(self._texts, response)
        return response.text


class CompletionStream(_Recorder):
    """Iterates the non-empty text deltas of a request, in order."""

    def __iter__(self) -> CompletionStream:
        return self

    def __next__(self) -> str:
        while self.completion is None:
            if text := self._record(next(self._responses)):
                return text
        raise StopIteration

    def close(self) -> None:
        """Cancel the request on the server if it has not ended."""
        self._responses.close()

    def __enter__(self) -> CompletionStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncCompletionStream(_Recorder):
    """The asyncio counterpart: `async for delta in stream`, `await stream.aclose()`."""

    def __aiter__(self) -> AsyncCompletionStream:
        return self

    async def __anext__(self) -> str:
        while self.completion is None:
            if text := self._record(await anext(self._responses)):
                return text
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel the request on the server if it has not ended."""
        await self._responses.aclose()

    async def __aenter__(self) -> AsyncCompletionStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
