"""Turn one Triton request's tensors and parameters into a prompt, SamplingParams and output choices.

Pure functions over numpy arrays and JSON, so every rule here is tested without a server. The tensors
arrive as Triton hands them to a batched model: with a leading batch dimension of 1, e.g. `text_input`
of shape [1, 1]. A bad request raises `BadRequest` with a message that names the offending field.

Sampling parameters may come from three places, as the clients of Triton's vLLM and TensorRT-LLM backends send
them. They are merged key by key, a later source winning over an earlier one:
  1. the request's parameters (the generate extension's "parameters");
  2. TensorRT-LLM's tensor inputs (`max_tokens`, `temperature`, `top_k`, `top_p`, `random_seed`, `min_length`,
     `end_id`, `stop_words`, `beam_width`);
  3. the `sampling_parameters` input, a JSON object (the vLLM backend's).
A string where a number or a boolean is expected is converted (the vLLM backend does the same; genai-perf sends
`{"max_tokens": "16"}`). JSON is bounded in size and depth, and NaN and Infinity are refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..refusal import Refusal
from ..sampling import SamplingParams
from .text_values import field_types, from_text

PROMPT_INPUTS = ("text_input", "input_ids")
FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_nfe",
    "return_log_probs",  # TensorRT-LLM's: the output tokens' log-probabilities (SamplingParams.logprobs, 0 unless set)
)
# TensorRT-LLM's scalar tensor inputs and the sampling parameter each one sets.
TENSOR_PARAMETERS = {
    "max_tokens": "max_tokens",
    "min_length": "min_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "random_seed": "seed",
}
TENSOR_INPUTS = (*TENSOR_PARAMETERS, "end_id", "stop_words", "beam_width")
INPUT_NAMES = PROMPT_INPUTS + ("sampling_parameters",) + FLAG_INPUTS + TENSOR_INPUTS

# A sampling-parameter object is a few dozen bytes; these bounds leave room for long stop lists and refuse
# what could only be an attack on the parser.
MAX_PARAMETERS_CHARS = 65536
MAX_JSON_DEPTH = 8

# Request settings of Triton's KServe protocol. Triton reads these from a gRPC infer request and does not pass them
# on; its generate endpoint passes every key that names no input to the model as a plain parameter and acts on none,
# so a client that sends one there gets a refusal that says so rather than a silent no-op.
TRITON_REQUEST_SETTINGS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")
# The output format of Triton's HTTP infer endpoint, which serves no decoupled model: gRPC and the generate endpoint
# both pass it on, and it changes nothing on either (gRPC answers in binary, generate in JSON), so it is taken and
# left unread, as a client that sets it by default expects.
IGNORED_PARAMETERS = ("binary_data_output",)


class BadRequest(Refusal):
    """The request cannot be served as sent; the message is returned to the client."""


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str | list[int]  # text, or token ids when the client sent `input_ids`
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_nfe: bool = False
    return_log_probs: bool = False


def parse_request(inputs: Mapping[str, np.ndarray], request_parameters: str = "") -> ParsedRequest:
    """`inputs` maps input names to the arrays that were sent; `request_parameters` is the request's
    parameters as JSON (the generate extension's "parameters")."""
    flags = {name: _read_bool(inputs, name) for name in FLAG_INPUTS}
    params = _read_sampling_params(inputs, request_parameters)
    if flags["return_log_probs"] and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    return ParsedRequest(prompt=_read_prompt(inputs), params=params, **flags)


def _read_prompt(inputs: Mapping[str, np.ndarray]) -> str | list[int]:
    if "input_ids" in inputs:
        if "text_input" in inputs:
            raise BadRequest("send either 'text_input' or 'input_ids', not both", "input_ids")
        ids = np.asarray(inputs["input_ids"])
        if ids.dtype not in (np.int64, np.int32):
            raise BadRequest(f"input 'input_ids' must be INT64, got {ids.dtype}", "input_ids")
        if ids.ndim > 2 or (ids.ndim == 2 and ids.shape[0] != 1):
            raise BadRequest(f"input 'input_ids' must hold one prompt, of shape [N] or [1, N]; got {list(ids.shape)}",
                             "input_ids")
        if ids.size == 0:
            raise BadRequest("input 'input_ids' is empty", "input_ids")
        return ids.reshape(-1).tolist()
    if "text_input" not in inputs:
        raise BadRequest("missing prompt: send 'text_input' (a string) or 'input_ids' (INT64 token ids)", "prompt")
    text = _read_string(inputs, "text_input")
    if not text:
        raise BadRequest("input 'text_input' is empty", "text_input")
    return text


def _read_sampling_params(inputs: Mapping[str, np.ndarray], request_parameters: str) -> SamplingParams:
    # (source, values) in the order they merge. The generate extension turns a "parameters" key that names an
    # input into that tensor, so TensorRT-LLM's inputs are request parameters too, as far as a client can tell.
    given = []
    if request_parameters and request_parameters.strip():
        values = _parse_json_object(request_parameters, "request parameters")
        _refuse_triton_settings(values)
        given.append(("request parameters", {k: v for k, v in values.items() if k not in IGNORED_PARAMETERS}))
    given.append(("request parameters", _read_tensor_parameters(inputs)))
    if "sampling_parameters" in inputs:
        raw = _read_string(inputs, "sampling_parameters")
        if raw.strip():
            given.append(("input 'sampling_parameters'", _parse_json_object(raw, "input 'sampling_parameters'")))
    values, sources = {}, []
    for source, source_values in given:
        if source_values:
            values.update(source_values)
            if source not in sources:
                sources.append(source)
    try:
        return SamplingParams.from_dict({key: _converted(key, value) for key, value in values.items()})
    except (TypeError, ValueError) as err:
        raise BadRequest(f"{' + '.join(sources) or 'sampling parameters'}: {err}",
                         getattr(err, "field", "sampling_parameters")) from None


def _refuse_triton_settings(request_parameters: dict) -> None:
    for key in TRITON_REQUEST_SETTINGS:
        if key in request_parameters:
            raise BadRequest(f"request parameter '{key}' is a Triton request setting, which the generate endpoint "
                             "passes to the model without acting on it; Triton reads it from a gRPC infer request",
                             key)


def _read_tensor_parameters(inputs: Mapping[str, np.ndarray]) -> dict:
    values = {}
    for name, key in TENSOR_PARAMETERS.items():
        if name in inputs:
            values[key] = _read_scalar(inputs, name)
    if "beam_width" in inputs and _read_scalar(inputs, "beam_width") != 1:
        raise BadRequest("input 'beam_width' must be 1: diffusion decoding has no beam search", "beam_width")
    if "end_id" in inputs:
        values["stop_token_ids"] = [_read_scalar(inputs, "end_id")]
    if "stop_words" in inputs:
        words = [_decoded(value, "stop_words") for value in np.asarray(inputs["stop_words"]).reshape(-1)]
        values["stop"] = [word for word in words if word]  # TensorRT-LLM clients send "" for none
    return values


def _converted(key: str, value):
    """A string where the field wants a number or a boolean, converted; anything else as it is, for
    SamplingParams to accept or refuse with its own message."""
    base = FIELD_TYPES.get(key)
    if not isinstance(value, str) or base not in (bool, int, float):
        return value
    try:
        return from_text(value, base)
    except ValueError:
        return value


FIELD_TYPES = field_types(SamplingParams)


def _parse_json_object(raw: str, source: str) -> dict:
    if len(raw) > MAX_PARAMETERS_CHARS:
        raise BadRequest(f"{source} has {len(raw)} characters; at most {MAX_PARAMETERS_CHARS} are accepted")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise BadRequest(f"{source} is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        values = json.loads(raw, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise BadRequest(f"{source} is not valid JSON: {err}") from None
    except ValueError as err:
        raise BadRequest(f"{source}: {err}") from None
    if not isinstance(values, dict):
        raise BadRequest(f"{source} must be a JSON object, got {type(values).__name__}")
    return values


def repeated_key(pairs: list[tuple[str, object]]) -> str | None:
    """The first key a JSON object gives twice (json's object_pairs_hook pairs), or None. JSON keeps the last value
    of a repeated key, which the client may not have meant; the model and the OpenAI front refuse it."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    key = repeated_key(pairs)
    if key is not None:
        raise ValueError(f"the key {key!r} is given more than once")
    return dict(pairs)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a sampling parameter can take")


def json_depth(raw: str) -> int:
    """The deepest nesting of arrays and objects, counted without parsing (brackets inside strings do not count),
    so that nesting too deep for the parser is refused before it recurses."""
    depth = deepest = 0
    in_string = escaped = False
    for char in raw:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _read_string(inputs: Mapping[str, np.ndarray], name: str) -> str:
    array = np.asarray(inputs[name])
    if array.dtype != np.object_ and array.dtype.kind not in "SU":
        raise BadRequest(f"input '{name}' must be a STRING (BYTES) tensor, got {array.dtype}", name)
    if array.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one string, got {array.size}", name)
    return _decoded(array.reshape(-1)[0], name)


def _decoded(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRequest(f"input '{name}' is not valid UTF-8: {err}", name) from None
    return str(value)


def _read_scalar(inputs: Mapping[str, np.ndarray], name: str):
    array = np.asarray(inputs[name])
    if array.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one value, got {array.size}", name)
    if array.dtype.kind not in "iuf":
        raise BadRequest(f"input '{name}' must be a number, got {array.dtype}", name)
    return array.reshape(-1)[0].item()


def _read_bool(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    if name not in inputs:
        return False
    array = np.asarray(inputs[name])
    if array.dtype != np.bool_:
        raise BadRequest(f"input '{name}' must be BOOL, got {array.dtype}", name)
    if array.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one value, got {array.size}", name)
    return bool(array.reshape(-1)[0])
