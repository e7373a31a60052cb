"""The OpenAI request and response bodies, field by field as the OpenAI API reference defines them.

Request models declare every field of the API, so that a field the front cannot honour is recognised and refused
by name (see refusals.py) rather than dropped. Extra fields are kept (`extra="allow"`): they carry the model's own
sampling parameters, as vLLM's server takes them. Request fields are strict: a value of another JSON type is a 400
that names the field, never converted (`true` is not the integer 1, `"5"` is not 5), and a float field takes only
finite numbers (JSON's `1e400` reads as infinity). Response models hold what the front sends back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# What a request body's models take: its own field types only, and finite numbers.
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _RequestBase(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow", **STRICT)

    model: str
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None

    def extra_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class CompletionRequest(_RequestBase):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation; `content` is a string or a list of content parts."""

    model_config = ConfigDict(extra="allow", **STRICT)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_RequestBase):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    audio: dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    moderation: Any = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """A completion choice's log-probabilities, per token of its text (the legacy completions shape)."""

    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A whole completion, or one chunk of a streamed one (the same object in the API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffulex"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
