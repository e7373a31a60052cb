"""Every request field of the pinned openai SDK's completion and chat create-params, walked: each is honoured, or
refused with a 400 that names it; never dropped in silence. A field the SDK gains fails this test until it is
given a decision here and in the front."""

import typing

import pytest
from front_requests import API_KEY, error_in, post
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from diffulex_backend import SamplingParams
from diffulex_client.openai_front.refusals import EXTRA_SAMPLING_FIELDS

BASE = {"model": "diffulex", "max_tokens": 4, "temperature": 0}
COMPLETION = {**BASE, "prompt": "hello"}
CHAT = {**BASE, "messages": [{"role": "user", "content": "hello"}]}

# field -> a value that asks for something (not the field's neutral value).
HONOURED_COMPLETION = {
    "model": "diffulex", "prompt": "hi", "max_tokens": 3, "n": 2, "seed": 5, "stop": ["x"], "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9, "user": "someone", "logprobs": 1,
}
REFUSED_COMPLETION = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"50": 5},
    "suffix": "end",
}
# The chat endpoint of the random test model has no template: honoured chat fields are checked on the demo front.
HONOURED_CHAT = {
    "model": None, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "max_completion_tokens": 3,
    "n": 2, "seed": 5, "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5,
    "top_p": 0.9, "user": "someone", "safety_identifier": "someone", "prompt_cache_key": "k", "logprobs": True,
    "top_logprobs": 2,
}
REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "mp3"}, "frequency_penalty": 1.0, "presence_penalty": -1.0,
    "function_call": "auto", "functions": [{"name": "f"}], "logit_bias": {"50": 5}, "metadata": {"k": "v"},
    "modalities": ["text", "audio"], "moderation": {"mode": "on"},
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {"x": 1}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "service_tier": "flex", "store": True, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}], "verbosity": "low",
    "web_search_options": {},
}


def sdk_fields(module) -> set[str]:
    # `stream` lives on the streaming and non-streaming subclasses, not on the base.
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def test_every_completion_field_of_the_sdk_has_a_decision():
    assert sdk_fields(completion_create_params) == set(HONOURED_COMPLETION) | set(REFUSED_COMPLETION)


def test_every_chat_field_of_the_sdk_has_a_decision():
    assert sdk_fields(chat_create_params) == set(HONOURED_CHAT) | set(REFUSED_CHAT)


@pytest.mark.parametrize("name", sorted(HONOURED_COMPLETION))
def test_an_honoured_completion_field_is_answered(front, name):
    body = {**COMPLETION, name: HONOURED_COMPLETION[name]}
    if name == "stream_options":
        body["stream"] = True
    response = post(front, "/v1/completions", body, API_KEY)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name", sorted(REFUSED_COMPLETION))
def test_a_refused_completion_field_is_a_400_naming_it(front, name):
    response = post(front, "/v1/completions", {**COMPLETION, name: REFUSED_COMPLETION[name]}, API_KEY)
    assert response.status_code == 400
    error = error_in(response.text)
    assert error["param"] == name and name in error["message"]


@pytest.mark.parametrize("name", sorted(HONOURED_CHAT))
def test_an_honoured_chat_field_is_answered(demo_front, name):
    body = {**CHAT, "model": "diffulex_openai_demo", "messages": [{"role": "user", "content": "1+2="}]}
    if HONOURED_CHAT[name] is not None:
        body[name] = HONOURED_CHAT[name]
    if name == "stream_options":
        body["stream"] = True
    if name == "top_logprobs":
        body["logprobs"] = True
    response = post(demo_front, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name", sorted(REFUSED_CHAT))
def test_a_refused_chat_field_is_a_400_naming_it(front, name):
    response = post(front, "/v1/chat/completions", {**CHAT, name: REFUSED_CHAT[name]}, API_KEY)
    assert response.status_code == 400
    error = error_in(response.text)
    assert error["param"] == name and name in error["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(front):
    neutral = {"best_of": 1, "echo": False, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {},
               "logprobs": None, "suffix": None}
    response = post(front, "/v1/completions", {**COMPLETION, **neutral}, API_KEY)
    assert response.status_code == 200, response.text


def test_the_extra_fields_are_the_models_sampling_parameters_less_the_openai_ones():
    assert set(EXTRA_SAMPLING_FIELDS) == set(SamplingParams.field_names()) - {
        "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs"}


def test_an_unknown_extra_field_is_a_400_naming_it(front):
    response = post(front, "/v1/completions", {**COMPLETION, "top_a": 0.2}, API_KEY)
    assert response.status_code == 400
    error = error_in(response.text)
    assert (error["param"], error["code"]) == ("top_a", "unknown_parameter")
