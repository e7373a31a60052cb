"""Every request field of the pinned openai SDK's completion and chat create-params, walked: each is honoured, or
refused with a 400 that names it; never dropped in silence. A field the SDK gains fails this test until it is
given a decision here and in the front."""

import json
import typing
from concurrent.futures import ThreadPoolExecutor

import pytest
from front_requests import API_KEY, error_in, post
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from diffulex_backend import SamplingParams
from diffulex_backend.serving.request_parsing import FIELD_TYPES
from diffulex_client.openai_front.refusals import EXTRA_SAMPLING_FIELDS, KIND_WORDS

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


# (field, a value of another JSON type, the param the 400 names): never converted, as a lax parser would (true to 1,
# "5" to 5, [true, false] to token ids [1, 0]).
WRONG_TYPES_COMPLETION = [
    ("max_tokens", True, "max_tokens"), ("max_tokens", "5", "max_tokens"), ("max_tokens", 5.0, "max_tokens"),
    ("n", True, "n"), ("seed", 1.5, "seed"), ("temperature", True, "temperature"), ("top_p", "0.9", "top_p"),
    ("stream", "yes", "stream"), ("logprobs", True, "logprobs"), ("prompt", [True, False], "prompt"),
    ("prompt", 5, "prompt"), ("stop", [1], "stop"), ("stream_options", {"include_usage": "yes"},
                                                    "stream_options.include_usage"),
    ("logit_bias", {"5": True}, "logit_bias.5"), ("logit_bias", {"int": "x"}, "logit_bias.int"),
    ("prompt", {"str": "x"}, "prompt"), ("stop", {"str": "x"}, "stop"),
    # The model's own settings, which the model would convert from a string (as Triton's request parameters send
    # them).
    ("min_tokens", "5", "min_tokens"), ("ignore_eos", " YES ", "ignore_eos"),
    ("accept_threshold", "0.5", "accept_threshold"),
]
WRONG_TYPES_CHAT = [
    ("logprobs", 1, "logprobs"), ("top_logprobs", True, "top_logprobs"),
    ("max_completion_tokens", True, "max_completion_tokens"), ("messages", [{"role": "user", "content": 5}],
                                                              "messages[0].content"),
    ("messages", [{"content": "hi"}], "messages[0].role"), ("parallel_tool_calls", 0, "parallel_tool_calls"),
    ("metadata", {"str": 5}, "metadata.str"),
]


WRONG_TYPES = ([("/v1/completions", COMPLETION, *case) for case in WRONG_TYPES_COMPLETION]
               + [("/v1/chat/completions", CHAT, *case) for case in WRONG_TYPES_CHAT])


@pytest.mark.parametrize("path, body, name, value, param", WRONG_TYPES, ids=str)
def test_a_field_of_another_json_type_is_a_400_naming_it(front, path, body, name, value, param):
    response = post(front, path, {**body, name: value}, API_KEY)
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert error["param"] == param and error["message"].startswith(param), error


def test_a_field_of_several_forms_names_them_all(front):
    """`prompt` takes four forms; a value of none of them is refused with all four named, where the first form's
    own complaint ("a valid string") would tell only a quarter of it."""
    response = post(front, "/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, API_KEY)
    assert response.status_code == 400
    error = error_in(response.text)
    assert error["param"] == "prompt"
    assert error["message"] == "prompt must take one of the forms str, list[str], list[int], list[list[int]]"


STRING_REFUSED = sorted(name for name in EXTRA_SAMPLING_FIELDS if FIELD_TYPES[name] in KIND_WORDS)


@pytest.mark.parametrize("name", STRING_REFUSED)
def test_every_model_setting_of_a_number_or_boolean_refuses_a_string_beside_a_request_that_is_served(front, name):
    """The class of the rows above: each of the model's settings that takes a number or a boolean refuses its value
    as a string, which the model would convert, and a request sent with it is served."""
    good = {**COMPLETION, "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        served = pool.submit(post, front, "/v1/completions", good, API_KEY)
        refused = post(front, "/v1/completions", {**COMPLETION, name: "1"}, API_KEY)
        assert served.result().status_code == 200
    assert refused.status_code == 400, refused.text
    error = error_in(refused.text)
    assert error["param"] == name and error["message"].startswith(f"{name}: must be "), error


@pytest.mark.parametrize("body", [
    '{"temperature": 1e400}', '{"top_p": -1e400}', '{"temperature": NaN}', '{"accept_threshold": 1e400}',
    '{"stop_token_ids": [1, 1e400]}',
], ids=str)
def test_a_number_that_is_not_finite_is_a_400_naming_its_field(front, body):
    """JSON's 1e400 reads as infinity, and NaN passes some parsers; neither reaches the model, whose sampling
    parameters JSON could not carry them."""
    name = body.split('"')[1]
    raw = json.dumps(COMPLETION)[:-1] + ", " + body[1:]
    response = post(front, "/v1/completions", raw, API_KEY)
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert error["param"] == name and "finite" in error["message"], error


def test_a_model_refusal_that_quotes_the_clients_text_stays_a_400(front):
    """The model's refusal quotes the value it refused; text of the client's that reads like an outage ("is not
    ready") does not make it a 503, which clients retry."""
    response = post(front, "/v1/completions", {**COMPLETION, "confidence": "is not ready"}, API_KEY)
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert error["param"] == "confidence" and "'is not ready'" in error["message"], error


def test_neutral_values_of_unsupported_chat_fields_are_accepted(demo_front):
    neutral = {"parallel_tool_calls": False, "metadata": {}, "store": False, "tools": [], "tool_choice": "none",
               "service_tier": "auto", "modalities": ["text"], "response_format": {"type": "text"}}
    response = post(demo_front, "/v1/chat/completions", {
        **CHAT, "model": "diffulex_openai_demo", "messages": [{"role": "user", "content": "1+2="}], **neutral})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("fields, param, code", [
    ({"max_tokens": 100_000}, "prompt", "context_length_exceeded"),
    ({"prompt": "x" * 600}, "prompt", "context_length_exceeded"),
    ({"prompt": [10**9]}, "prompt", None),
    ({"lora_name": "is not ready"}, "lora_name", None),
], ids=str)
def test_a_model_refusal_names_the_field_at_fault(front, fields, param, code):
    """The model's refusals of a prompt (too long for max_tokens and the model's length, a token id outside the
    vocabulary) and of a setting name the field, as the front's own do; text of the client's that reads like an
    outage leaves it a 400."""
    response = post(front, "/v1/completions", {**COMPLETION, **fields}, API_KEY)
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert (error["param"], error["code"]) == (param, code), error


@pytest.mark.parametrize("fields, param", [
    ({"stop": "x" * 70_000}, "stop"),
    ({"stop": ["y" * 1100] * 64}, "stop"),
    ({"stop_token_ids": [[[[[[[[[1]]]]]]]]]}, "stop_token_ids"),
    ({"lora_name": "a", "stop_token_ids": [7] * 25_000}, "stop_token_ids"),
], ids=lambda value: str(value)[:60])
def test_sampling_parameters_too_large_or_too_deep_for_the_model_name_their_field(front, fields, param):
    """The model takes its sampling parameters as one JSON input of at most 65536 characters and 8 levels; the
    front refuses a request past either bound by the field that takes it there, where the model's refusal would
    name its input."""
    response = post(front, "/v1/completions", {**COMPLETION, **fields}, API_KEY)
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert error["param"] == param and error["message"].startswith(param), error
    assert "sampling_parameters" not in error["message"]
    # Within the bounds the same field reaches the model.
    assert post(front, "/v1/completions", {**COMPLETION, "stop": "x" * 100}, API_KEY).status_code == 200


def test_a_chat_too_long_for_the_model_names_its_messages(demo_front):
    response = post(demo_front, "/v1/chat/completions", {
        **CHAT, "model": "diffulex_openai_demo", "messages": [{"role": "user", "content": "1+2="}],
        "max_tokens": 100_000})
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded"), error


@pytest.mark.parametrize("raw, key", [
    ('{"model": "diffulex", "prompt": "hello", "max_tokens": 4, "max_tokens": 100}', "max_tokens"),
    ('{"model": "diffulex", "prompt": "hello", "max_tokens": 4, "stream": true, '
     '"stream_options": {"include_usage": true, "include_usage": false}}', "include_usage"),
], ids=["top level", "nested"])
def test_a_key_given_twice_is_a_400_naming_it(front, raw, key):
    """A parser that keeps the last of a repeated key would answer one of the two questions the client asked."""
    response = post(front, "/v1/completions", raw, API_KEY)
    assert response.status_code == 400, response.text
    error = error_in(response.text)
    assert error["param"] == key and "more than once" in error["message"], error
