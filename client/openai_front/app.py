"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions and /health.

A request is checked (schema, refused fields, model name), admitted by the readiness watch, turned into one Triton
request per choice, and answered from their responses: whole, or as server-sent events, one chunk per committed
block. A streamed request waits for its first response before it answers, so an error that comes before any text
still gets its own HTTP status; an error after that ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from diffulex_backend.serving.request_parsing import repeated_key

from .adapter import TritonRequest, completion_prompts, triton_requests
from .chat_template import ChatTemplate
from .errors import OpenAIError, error_body
from .generation import ChoiceResponse, generate
from .readiness import OpenRequest, Readiness, ReadinessWatch
from .refusals import refuse_unsupported
from .request_guard import RequestGuard
from .responses import (SSE_DONE, Collected, LogprobsFormat, TokenNames, UsageCount, chat_chunk, completion_chunk,
                        sse_event)
from .schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .settings import FrontSettings
from .triton_stream import ErrorClass, TritonStreamError, open_channel

log = logging.getLogger("diffulex_client.openai_front")

DISCONNECT_POLL_S = 0.1
# How the model names a refused sampling parameter, after the source of the parameters where it gives one.
MODEL_PARAMETER = re.compile(r"(?:[^:]+: )?sampling parameter '(\w+)'")
# How the model refuses a prompt (engine.py): too long to leave room for max_tokens, or for the KV cache (either
# group: the context length), too long in characters, empty, holding a token id out of range or the mask token.
PROMPT_FAULT = re.compile(r"prompt (?:(has \d+ tokens and max_tokens)|has \d+ characters|token id |is empty|holds )"
                          r"|(request needs up to \d+ KV pages)")
# The name pydantic gives a form of a field that takes several (`prompt`): a type, not a field.
UNION_FORM = re.compile(r"(str|int|float|bool|none|list|dict)(\[.*\])?")
TRITON_ERROR_STATUS = {ErrorClass.BAD_REQUEST: HTTPStatus.BAD_REQUEST,
                       ErrorClass.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
                       ErrorClass.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR}


def create_app(settings: FrontSettings, chat_template: ChatTemplate | None = None) -> RequestGuard:
    """The ASGI app: the FastAPI app behind the request guard (API key, body size). `chat_template` defaults to the
    one the settings name."""
    template = chat_template or ChatTemplate.load(settings.tokenizer, settings.chat_template)
    names = TokenNames(template.tokenizer)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = open_channel(settings.triton_url)
        watch = ReadinessWatch(client, settings.model, settings.triton_url)
        await watch.poll()
        watch.start()
        # Rendering and tokenizing a conversation takes seconds for a prompt of a megabyte: it runs in this thread,
        # off the event loop, which serves every other request meanwhile. One chat waits for the one before it.
        tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-template")
        app.state.client, app.state.watch, app.state.tokenizing = client, watch, tokenizing
        try:
            yield
        finally:
            tokenizing.shutdown(wait=False, cancel_futures=True)
            await watch.stop()
            await client.close()

    app = FastAPI(title="diffulex OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app)

    @app.get("/health")
    async def health(request: Request):
        watch: ReadinessWatch = request.app.state.watch
        if watch.state is not Readiness.READY:
            return watch.unavailable_error().response()
        return {"status": "ready", "model": settings.model}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model, created=created)])

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> ModelCard:
        _check_model(model_id, settings.model)
        return ModelCard(id=settings.model, created=created)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parsed(request, CompletionRequest)
        _check_request(body, settings.model)
        requests = triton_requests(body, completion_prompts(body))
        return await _answer(request, body, requests, settings.model, names, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parsed(request, ChatCompletionRequest)
        _check_request(body, settings.model)
        prompt_ids = await asyncio.get_running_loop().run_in_executor(request.app.state.tokenizing,
                                                                      template.prompt_ids, body.messages)
        requests = triton_requests(body, [prompt_ids])
        return await _answer(request, body, requests, settings.model, names, chat=True)

    return RequestGuard(app, settings.max_body_bytes, settings.api_key)


async def _parsed(request: Request, schema: type[BaseModel]):
    """The body as `schema`, whatever Content-Type the client sent (curl's -d sends a form type); a body that is
    not a JSON object of the schema's fields, or that gives a key twice, is a 400 that names the field at fault."""
    raw = await request.body()
    try:
        parsed = schema.model_validate_json(raw)
    except ValidationError as err:
        problems = err.errors()
        # The body tells a key of the client's from a form's name, where a name in the location reads like one.
        forms_named = any(UNION_FORM.fullmatch(str(part)) for problem in problems for part in problem["loc"])
        raise _validation_error(problems, _json_value(raw) if forms_named else None) from None
    # Parsed once more for its keys alone: the schema's parser keeps a repeated key's last value, which would answer
    # a question the client asked twice, two ways, by one of them. Its depth is the schema parser's, far under
    # Python's recursion limit.
    json.loads(raw, object_pairs_hook=_unique_keys)
    return parsed


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    key = repeated_key(pairs)
    if key is not None:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"the request body gives the key '{key}' more than once", param=key)
    return dict(pairs)


def _json_value(raw: bytes):
    """The body as JSON, or None where it is not JSON that Python's parser reads."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _validation_error(problems, body=None) -> OpenAIError:
    """The 400 of the first problem: its field's path as `param` (`messages[0].role`), and, where the field takes
    one of several forms (`prompt`), the forms it may take, since each form's own message tells only half. `body`,
    the request's JSON where it has been read, tells the client's own keys from the forms' names."""
    problem = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    path, forms = _field_path(problem.get("loc", ()), body, problems)
    message = f"{path}: {problem.get('msg')}" if path else str(problem.get("msg"))
    if forms:  # each form pydantic tried for this field is a problem of its own, the form at the same place
        place = tuple(problem["loc"]).index(forms[0])
        field = tuple(problem["loc"][:place])
        tried = dict.fromkeys(str(p["loc"][place]) for p in problems
                              if tuple(p["loc"][:place]) == field and len(p["loc"]) > place)
        message = f"{path} must take one of the forms {', '.join(tried)}"
    if problem.get("type") in ("json_invalid", "model_type", "model_attributes_type"):
        message = f"the request body must be a JSON object: {message}"
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=path or None)


def _field_path(location, body=None, problems=()) -> tuple[str, list[str]]:
    """A validation error's location as the field's path (`messages[0].content`), and the forms of a field of
    several that pydantic names in it (`str`, `list[int]`), which are not fields. A name that reads like a form's is
    a key of the client's object (`logit_bias`'s "int") where the body, followed along the location, holds it and
    every other problem at that place names a key of it too: a field of several forms gets a problem for each form,
    and not every form's name is a key of the object given for it."""
    path, forms, node = "", [], body
    for place, part in enumerate(location):
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
        elif not UNION_FORM.fullmatch(str(part)) or _keys_of(node, location[:place], problems):
            path += f".{part}" if path else str(part)
            node = node.get(part) if isinstance(node, dict) else None
        else:
            forms.append(str(part))
    return path, forms


def _keys_of(node, place: tuple, problems) -> bool:
    """Whether every problem at `place` names a key of `node` there."""
    named = {problem["loc"][len(place)] for problem in problems
             if tuple(problem["loc"][:len(place)]) == tuple(place) and len(problem["loc"]) > len(place)}
    return isinstance(node, dict) and bool(named) and named <= node.keys()


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"the model '{name}' does not exist; this server serves '{served}'",
                          param="model", code="model_not_found")


def _check_request(body: CompletionRequest | ChatCompletionRequest, served: str) -> None:
    _check_model(body.model, served)
    refuse_unsupported(body)


async def _answer(request: Request, body, requests: list[TritonRequest], model: str, names: TokenNames,
                  chat: bool):
    watch: ReadinessWatch = request.app.state.watch
    open_request = watch.admit()
    arrivals = generate(request.app.state.client, model, requests, open_request, watch.ids_datatype)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    # Until a streamed response has begun, nothing cancels this handler when its client leaves; this does.
    watcher = asyncio.create_task(_end_on_disconnect(request, open_request))
    try:
        if not body.stream:
            return await _whole(arrivals, LogprobsFormat(names), response_id, created, model, chat)
        first = await _first(arrivals, chat)
    except BaseException:
        watch.release(open_request)
        await arrivals.aclose()
        raise
    finally:
        watcher.cancel()
        if not body.stream:
            watch.release(open_request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _events(first, arrivals, LogprobsFormat(names), response_id, created, model, chat, include_usage)
    return StreamingResponse(_released(events, watch, open_request, arrivals), media_type="text/event-stream")


def _from_triton(err: TritonStreamError, chat: bool) -> OpenAIError:
    """The field at fault: a refused sampling parameter's name, which the model's message gives, or the prompt (a
    chat's messages) where the model refused that (PROMPT_FAULT)."""
    if (named := MODEL_PARAMETER.match(err.message)) is not None:
        return OpenAIError(TRITON_ERROR_STATUS[err.kind], err.message, param=named.group(1))
    if (fault := PROMPT_FAULT.match(err.message)) is not None:
        return OpenAIError(TRITON_ERROR_STATUS[err.kind], err.message, param="messages" if chat else "prompt",
                           code="context_length_exceeded" if fault.group(1) or fault.group(2) else None)
    return OpenAIError(TRITON_ERROR_STATUS[err.kind], err.message)


async def _first(arrivals: AsyncIterator[ChoiceResponse], chat: bool) -> ChoiceResponse:
    try:
        return await anext(arrivals)
    except TritonStreamError as err:
        raise _from_triton(err, chat) from None


async def _whole(arrivals, logprobs: LogprobsFormat, response_id: str, created: int, model: str,
                 chat: bool) -> JSONResponse:
    collected = Collected(logprobs)
    try:
        async for arrival in arrivals:
            collected.add(arrival)
    except TritonStreamError as err:
        raise _from_triton(err, chat) from None
    build = collected.chat_completion if chat else collected.completion
    return JSONResponse(build(response_id, created, model).model_dump())


async def _end_on_disconnect(request: Request, open_request: OpenRequest) -> None:
    """Ends the request's generation when its client has closed the connection."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    open_request.end(OpenAIError(HTTPStatus.BAD_REQUEST, "the client closed the connection"))


async def _events(first: ChoiceResponse, arrivals, logprobs: LogprobsFormat, response_id: str, created: int,
                  model: str, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    usage = UsageCount()
    started: set[int] = set()

    def chunk(arrival: ChoiceResponse) -> bytes:
        usage.add(arrival)
        if chat:
            body = chat_chunk(arrival, arrival.request.index not in started, logprobs, response_id, created, model)
            started.add(arrival.request.index)
        else:
            body = completion_chunk(arrival, logprobs, response_id, created, model)
        return sse_event(_with_usage_field(body.model_dump(), include_usage))

    try:
        yield chunk(first)
        async for arrival in arrivals:
            yield chunk(arrival)
    except TritonStreamError as err:
        yield sse_event(_from_triton(err, chat).body())
        yield SSE_DONE
        return
    except OpenAIError as err:
        yield sse_event(err.body())
        yield SSE_DONE
        return
    if include_usage:
        kind = "chat.completion.chunk" if chat else "text_completion"
        yield sse_event({"id": response_id, "object": kind, "created": created, "model": model, "choices": [],
                         "usage": usage.usage().model_dump()})
    yield SSE_DONE


def _with_usage_field(body: dict, include_usage: bool) -> dict:
    """Chunks carry `usage: null` only when the client asked for usage, as OpenAI's do."""
    if not include_usage:
        body.pop("usage", None)
    return body


async def _released(events: AsyncIterator[bytes], watch: ReadinessWatch, open_request: OpenRequest,
                    arrivals) -> AsyncIterator[bytes]:
    """The events; whatever ends them (the last one, an error, a client that left), the Triton streams close."""
    try:
        async for event in events:
            yield event
    finally:
        watch.release(open_request)
        await arrivals.aclose()


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        return _validation_error(err.errors()).response()

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, err: ClientDisconnect):
        # The client closed its connection before its request was read: no one is left to answer, and nothing of
        # the server's went wrong, so one line says so where the handler of the unexpected logged two tracebacks.
        log.info("the client closed the connection before its request on %s was read", request.url.path)
        return Response(status_code=HTTPStatus.BAD_REQUEST)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception):
        log.exception("unexpected error on %s", request.url.path)
        status = HTTPStatus.INTERNAL_SERVER_ERROR
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", status), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        status = HTTPStatus(err.status_code)
        return JSONResponse(error_body(str(err.detail), status), status_code=status, headers=err.headers)
