"""Turn one Triton request's tensors and parameters into a prompt, SamplingParams and output choices.

Pure functions over numpy arrays and JSON, so every rule here is tested without a server. The tensors
arrive as Triton hands them to a batched model: with a leading batch dimension of 1, e.g. `text_input`
of shape [1, 1]. A bad request raises `BadRequest` with a message that names the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..sampling import SamplingParams

PROMPT_INPUTS = ("text_input", "input_ids")
FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_nfe",
)
INPUT_NAMES = PROMPT_INPUTS + ("sampling_parameters",) + FLAG_INPUTS


class BadRequest(ValueError):
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


def parse_request(inputs: Mapping[str, np.ndarray], request_parameters: str = "") -> ParsedRequest:
    """`inputs` maps input names to the arrays that were sent; `request_parameters` is the request's
    parameters as JSON (the generate extension's "parameters"), read when no `sampling_parameters` input
    is given."""
    flags = {name: _read_bool(inputs, name) for name in FLAG_INPUTS}
    return ParsedRequest(prompt=_read_prompt(inputs), params=_read_sampling_params(inputs, request_parameters), **flags)


def _read_prompt(inputs: Mapping[str, np.ndarray]) -> str | list[int]:
    if "input_ids" in inputs:
        if "text_input" in inputs:
            raise BadRequest("send either 'text_input' or 'input_ids', not both")
        ids = np.asarray(inputs["input_ids"])
        if ids.dtype != np.int32:
            raise BadRequest(f"input 'input_ids' must be INT32, got {ids.dtype}")
        if ids.size == 0:
            raise BadRequest("input 'input_ids' is empty")
        return ids.reshape(-1).tolist()
    if "text_input" not in inputs:
        raise BadRequest("missing prompt: send 'text_input' (a string) or 'input_ids' (INT32 token ids)")
    text = _read_string(inputs, "text_input")
    if not text:
        raise BadRequest("input 'text_input' is empty")
    return text


def _read_sampling_params(inputs: Mapping[str, np.ndarray], request_parameters: str) -> SamplingParams:
    if "sampling_parameters" in inputs:
        source, raw = "input 'sampling_parameters'", _read_string(inputs, "sampling_parameters")
    else:
        source, raw = "request parameters", request_parameters
    values = _parse_json_object(raw, source) if raw.strip() else {}
    try:
        return SamplingParams.from_dict(values)
    except (TypeError, ValueError) as err:
        raise BadRequest(f"{source}: {err}") from None


def _parse_json_object(raw: str, source: str) -> dict:
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as err:
        raise BadRequest(f"{source} is not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise BadRequest(f"{source} must be a JSON object, got {type(values).__name__}")
    return values


def _read_string(inputs: Mapping[str, np.ndarray], name: str) -> str:
    array = np.asarray(inputs[name])
    if array.dtype != np.object_ and array.dtype.kind not in "SU":
        raise BadRequest(f"input '{name}' must be a STRING (BYTES) tensor, got {array.dtype}")
    if array.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one string, got {array.size}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRequest(f"input '{name}' is not valid UTF-8: {err}") from None
    return str(value)


def _read_bool(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    if name not in inputs:
        return False
    array = np.asarray(inputs[name])
    if array.dtype != np.bool_:
        raise BadRequest(f"input '{name}' must be BOOL, got {array.dtype}")
    if array.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one value, got {array.size}")
    return bool(array.reshape(-1)[0])
