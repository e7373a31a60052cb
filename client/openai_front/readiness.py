"""The model's readiness as the front sees it, polled over gRPC, and the open requests it ends when that is lost.

Triton 2.51 never answers the requests in flight on a stub that died; the model's watchdog marks the model not
ready at once and reloads it. Polling every POLL_INTERVAL_S, the watch sees the model go not ready within a second
and ends every open request of the front, so that none of its clients waits on a stream that will never end.
"""

from __future__ import annotations

import asyncio
import enum
import logging

import tritonclient.grpc.aio as grpcclient_aio

from .errors import OpenAIError, unavailable

POLL_INTERVAL_S = 0.25
POLL_TIMEOUT_S = 0.5

log = logging.getLogger("diffulex_client.openai_front")


class Readiness(enum.Enum):
    UNKNOWN = "unknown"  # not polled yet
    READY = "ready"
    MODEL_NOT_READY = "model_not_ready"  # tritonserver answers, the model is loading, reloading or absent
    SERVER_UNREACHABLE = "server_unreachable"


class OpenRequest:
    """One request in flight: the watch sets `ended` with the error that ends it."""

    def __init__(self):
        self.ended = asyncio.Event()
        self.error: OpenAIError | None = None

    def end(self, error: OpenAIError) -> None:
        if not self.ended.is_set():
            self.error = error
            self.ended.set()


class ReadinessWatch:
    def __init__(self, client: grpcclient_aio.InferenceServerClient, model: str, triton_url: str):
        self._client = client
        self._model = model
        self._triton_url = triton_url
        self.state = Readiness.UNKNOWN
        self.input_datatypes: dict[str, str] = {}  # the model's inputs by name, from its metadata
        self._open: set[OpenRequest] = set()
        self._task: asyncio.Task | None = None

    def unavailable_error(self) -> OpenAIError:
        if self.state is Readiness.SERVER_UNREACHABLE:
            return unavailable(f"tritonserver at {self._triton_url} cannot be reached; retry later")
        return unavailable(f"model '{self._model}' is not ready; retry later")

    async def poll(self) -> Readiness:
        try:
            ready = await self._client.is_model_ready(self._model, client_timeout=POLL_TIMEOUT_S)
            state = Readiness.READY if ready else Readiness.MODEL_NOT_READY
            if state is Readiness.READY and self.state is not Readiness.READY:
                await self._read_input_types()
        except Exception:  # any failure to get an answer means the server cannot be reached
            state = Readiness.SERVER_UNREACHABLE
        if state is not self.state:
            log.info("model %s: %s -> %s", self._model, self.state.value, state.value)
        self.state = state
        if state is not Readiness.READY:
            self._end_open_requests()
        return state

    async def _read_input_types(self) -> None:
        """The model's declared input types, read whenever it (re)becomes ready: a reload may bring a new config."""
        metadata = await self._client.get_model_metadata(self._model, as_json=True, client_timeout=POLL_TIMEOUT_S)
        self.input_datatypes = {item["name"]: item["datatype"] for item in metadata.get("inputs", [])}

    @property
    def ids_datatype(self) -> str:
        """What `input_ids` takes: INT32 or INT64, as the served config.pbtxt declares it."""
        return self.input_datatypes.get("input_ids", "INT32")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(POLL_INTERVAL_S)

    def admit(self) -> OpenRequest:
        """Register a new request, or raise 503 when the model is not known to be ready."""
        if self.state is not Readiness.READY:
            raise self.unavailable_error()
        request = OpenRequest()
        self._open.add(request)
        return request

    def release(self, request: OpenRequest) -> None:
        self._open.discard(request)

    def _end_open_requests(self) -> None:
        error = self.unavailable_error()
        for request in list(self._open):
            request.end(error)
