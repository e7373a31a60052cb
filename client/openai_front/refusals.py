"""Which OpenAI fields the front honours, and the 400 that names each one it cannot.

Every request field of the API is declared in schemas.py. A field the front does not implement is accepted only at
its neutral value (absent, null, or the value that asks for nothing: `echo: false`, `n`-like 1, penalties 0), and
refused by name otherwise: a silently ignored field would give a client an answer to a question it did not ask.
`user`, `safety_identifier` and `prompt_cache_key` are accepted and ignored, because they change nothing in an answer.

Fields outside the API are the model's own sampling parameters (thresholds, `min_tokens`, `lora_name`, ...), taken as
vLLM's server takes them (the SDK's `extra_body`). Their names come from the model's SamplingParams, less those the
API names itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from diffulex_backend.sampling import MAX_LOGPROBS, SamplingParams
from diffulex_backend.serving.request_parsing import FIELD_TYPES

from .errors import bad_request
from .schemas import ChatCompletionRequest

# Model sampling parameters that OpenAI fields set (max_tokens, temperature, top_p, seed, stop, logprobs).
OPENAI_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "logprobs")
EXTRA_SAMPLING_FIELDS = tuple(name for name in SamplingParams.field_names() if name not in OPENAI_SAMPLING_FIELDS)

NO_TOOLS = "tools and function calling are not supported by this server"
# What a setting of each of these types takes, in words. The model converts a string given for such a setting, as
# Triton's request parameters and TensorRT-LLM's clients send them; in JSON "5" is not 5, so the front refuses it.
KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number"}


def _absent(value) -> bool:
    return value is None


def _absent_or(*neutral) -> Callable[[Any], bool]:
    return lambda value: value is None or value in neutral


# field -> (is the value one the front can honour, why another value is refused)
SHARED_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_absent_or(0), "repetition penalties are not supported by diffusion decoding"),
    "presence_penalty": (_absent_or(0), "repetition penalties are not supported by diffusion decoding"),
    "logit_bias": (_absent_or({}), "logit_bias is not supported by this server"),
}
COMPLETION_RULES = SHARED_RULES | {
    "best_of": (_absent_or(1), "best_of above 1 is not supported: use n"),
    "echo": (_absent_or(False), "echo is not supported"),
    "suffix": (_absent_or(""), "suffix (insertion) is not supported"),
}
CHAT_RULES = SHARED_RULES | {
    "audio": (_absent, "audio output is not supported"),
    "function_call": (_absent_or("none"), NO_TOOLS),
    "functions": (_absent_or([]), NO_TOOLS),
    "metadata": (_absent_or({}), "stored completions are not supported, so metadata has nothing to label"),
    "modalities": (lambda value: value is None or value == ["text"], "only text output is supported"),
    "moderation": (_absent, "moderation is not supported"),
    "parallel_tool_calls": (_absent_or(False), NO_TOOLS),
    "prediction": (_absent, "predicted outputs are not supported"),
    "prompt_cache_options": (_absent, "prompt cache options are not supported"),
    "prompt_cache_retention": (_absent, "prompt cache retention is not supported"),
    "reasoning_effort": (_absent, "reasoning_effort is not supported"),
    "response_format": (lambda value: value is None or value == {"type": "text"},
                        "structured output (response_format) is not supported"),
    "service_tier": (_absent_or("auto", "default"), "service tiers are not supported"),
    "store": (_absent_or(False), "stored completions are not supported"),
    "tool_choice": (_absent_or("none"), NO_TOOLS),
    "tools": (_absent_or([]), NO_TOOLS),
    "verbosity": (_absent, "verbosity is not supported"),
    "web_search_options": (_absent, "web search is not supported"),
}
# Accepted and ignored: identifiers and routing hints that change nothing in an answer.
IGNORED_FIELDS = ("user", "safety_identifier", "prompt_cache_key")


def refuse_unsupported(request: BaseModel) -> None:
    """Raise a 400 that names the first field the front cannot honour."""
    rules = CHAT_RULES if isinstance(request, ChatCompletionRequest) else COMPLETION_RULES
    for name, (honoured, reason) in rules.items():
        if not honoured(getattr(request, name)):
            raise bad_request(f"'{name}' is not supported: {reason}", param=name, code="unsupported_parameter")
    _check_logprobs(request)
    if request.stream_options is not None:
        if not request.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if request.stream_options.include_obfuscation:
            raise bad_request("'stream_options.include_obfuscation' is not supported",
                              param="stream_options.include_obfuscation", code="unsupported_parameter")
    for name, value in request.extra_fields().items():
        if name not in EXTRA_SAMPLING_FIELDS:
            raise bad_request(f"unknown field '{name}'; besides the OpenAI fields this server takes the model's "
                              f"sampling parameters {list(EXTRA_SAMPLING_FIELDS)}", param=name,
                              code="unknown_parameter")
        if not _finite(value):  # JSON's 1e400 reads as infinity, which the model's JSON cannot carry
            raise bad_request(f"'{name}' must hold finite numbers only", param=name)
        if isinstance(value, str) and (kind := KIND_WORDS.get(FIELD_TYPES[name])) is not None:
            raise bad_request(f"{name}: must be {kind}, not a string", param=name)


def _finite(value) -> bool:
    """No infinity or NaN anywhere in a JSON value."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    return True


def _check_logprobs(request: BaseModel) -> None:
    """Completions take `logprobs`, the number of most likely tokens; chat takes `logprobs` (true or false) and
    `top_logprobs`, which needs it. Both numbers lie in [0, MAX_LOGPROBS]."""
    name = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
    count = getattr(request, name)
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise bad_request(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}], got {count}", param=name)
    if name == "top_logprobs" and count is not None and not request.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")


def supported_fields(request_type: type[BaseModel]) -> set[str]:
    """The declared fields the front honours at any value (for the documentation and the field walk)."""
    rules = CHAT_RULES if request_type is ChatCompletionRequest else COMPLETION_RULES
    return set(request_type.model_fields) - set(rules) - set(IGNORED_FIELDS)

