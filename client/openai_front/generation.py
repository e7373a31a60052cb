"""The Triton streams of one OpenAI request, read together: their responses in arrival order, tagged with the
choice they belong to, until every choice has its final response.

The request ends early, with its OpenRequest's error, when the readiness watch or a client disconnect ends it. On
any exit every stream still open is cancelled first, without awaiting anything, so that a cancelled handler still
frees the model's KV pages; the calls of streams that ended are then closed by the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import tritonclient.grpc.aio as grpcclient_aio

from ..messages import ModelResponse
from .adapter import TritonRequest
from .readiness import OpenRequest
from .triton_stream import TritonStream, TritonStreamError


@dataclass(frozen=True)
class ChoiceResponse:
    request: TritonRequest
    response: ModelResponse


async def generate(client: grpcclient_aio.InferenceServerClient, model: str, requests: list[TritonRequest],
                   open_request: OpenRequest, ids_datatype: str = "INT32") -> AsyncIterator[ChoiceResponse]:
    """Raises TritonStreamError for a stream that fails, OpenAIError when the request is ended from outside."""
    streams = [TritonStream(client, model, request.inputs(ids_datatype)) for request in requests]
    arrivals: asyncio.Queue = asyncio.Queue()  # (request, ModelResponse or TritonStreamError)

    async def pump(request: TritonRequest, stream: TritonStream) -> None:
        try:
            async for response in stream:
                arrivals.put_nowait((request, response))
        except TritonStreamError as err:
            arrivals.put_nowait((request, err))

    pumps = [asyncio.create_task(pump(r, s)) for r, s in zip(requests, streams)]
    ended = asyncio.create_task(open_request.ended.wait())
    unfinished = len(requests)
    arrival: asyncio.Task | None = None
    try:
        while unfinished:
            arrival = asyncio.create_task(arrivals.get())
            done, _ = await asyncio.wait({arrival, ended}, return_when=asyncio.FIRST_COMPLETED)
            if arrival not in done:
                raise open_request.error
            request, item = arrival.result()
            if isinstance(item, TritonStreamError):
                raise item
            if item.is_final:
                unfinished -= 1
            yield ChoiceResponse(request, item)
    finally:
        # The wait for the next arrival is still pending when the request ends from outside or the handler is
        # cancelled (its client left); cancelled here, it leaves no task behind.
        if arrival is not None:
            arrival.cancel()
        ended.cancel()
        for task in pumps:
            task.cancel()
        for stream in streams:
            stream.cancel_if_open()
        # Shielded: a choice that has ended waits for the server to end its call, even when the handler is
        # cancelled (its client left); cancelling such a call right after its final response can leave that
        # response unreleased in Triton 2.51, which then never unloads the model.
        await asyncio.shield(asyncio.gather(*(stream.aclose() for stream in streams)))
