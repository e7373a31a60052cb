"""Request parsing, response building and engine settings: the serving rules, checked without a server."""

import json

import numpy as np
import pytest

from diffulex_backend import FinishReason, SamplingParams, StepOutput
from diffulex_backend.serving.engine_settings import engine_settings
from diffulex_backend.serving.request_parsing import BadRequest, parse_request
from diffulex_backend.serving.response_building import ResponseAssembler


def text(value: str) -> np.ndarray:  # a STRING input as Triton hands it to a batched model: [1, 1]
    return np.array([[value.encode()]], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([[value]], dtype=np.bool_)


# ---- parsing ----------------------------------------------------------------------------------------------
def test_text_prompt_with_sampling_parameters_json():
    parsed = parse_request({
        "text_input": text("12+34="),
        "sampling_parameters": text('{"max_tokens": 7, "temperature": 0.5, "top_k": 3, "stop": ["\\n"]}'),
        "stream": flag(True),
        "return_nfe": flag(True),
    })
    assert parsed.prompt == "12+34="
    assert parsed.params == SamplingParams(max_tokens=7, temperature=0.5, top_k=3, stop=["\n"])
    assert parsed.stream and parsed.return_nfe
    assert not (parsed.exclude_input_in_output or parsed.return_finish_reason or parsed.return_num_input_tokens
                or parsed.return_num_output_tokens)


def test_input_ids_prompt():
    parsed = parse_request({"input_ids": np.array([[5, 6, 7]], dtype=np.int32)})
    assert parsed.prompt == [5, 6, 7]
    assert parsed.params == SamplingParams()


def test_request_parameters_are_read_when_no_sampling_parameters_input():
    parsed = parse_request({"text_input": text("hi")}, json.dumps({"max_tokens": 3, "seed": 11}))
    assert parsed.params == SamplingParams(max_tokens=3, seed=11)


def test_sampling_parameters_input_takes_precedence_over_request_parameters():
    parsed = parse_request({"text_input": text("hi"), "sampling_parameters": text('{"max_tokens": 4}')},
                           json.dumps({"max_tokens": 9}))
    assert parsed.params.max_tokens == 4


@pytest.mark.parametrize("inputs, parameters, message", [
    ({}, "", "missing prompt: send 'text_input' (a string) or 'input_ids' (INT32 token ids)"),
    ({"text_input": text("")}, "", "input 'text_input' is empty"),
    ({"text_input": text("a"), "input_ids": np.array([[1]], dtype=np.int32)}, "",
     "send either 'text_input' or 'input_ids', not both"),
    ({"input_ids": np.zeros((1, 0), dtype=np.int32)}, "", "input 'input_ids' is empty"),
    ({"input_ids": np.array([[1.0]], dtype=np.float32)}, "", "input 'input_ids' must be INT32, got float32"),
    ({"text_input": text("a"), "stream": np.array([[1]], dtype=np.int32)}, "",
     "input 'stream' must be BOOL, got int32"),
    ({"text_input": text("a"), "sampling_parameters": text("{max_tokens: 3")}, "",
     "input 'sampling_parameters' is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    ({"text_input": text("a"), "sampling_parameters": text("[1, 2]")}, "",
     "input 'sampling_parameters' must be a JSON object, got list"),
    ({"text_input": text("a")}, '{"max_token": 3}',
     "request parameters: unknown sampling parameter(s) ['max_token']; allowed: "
     f"{SamplingParams.field_names()}"),
    ({"text_input": text("a"), "sampling_parameters": text('{"max_tokens": -1}')}, "",
     "input 'sampling_parameters': sampling parameter 'max_tokens' must be an integer >= 1, got -1"),
    ({"text_input": text("a"), "sampling_parameters": text('{"temperature": "hot"}')}, "",
     "input 'sampling_parameters': sampling parameter 'temperature' must be a number >= 0, got 'hot'"),
])
def test_bad_request_names_the_bad_field(inputs, parameters, message):
    with pytest.raises(BadRequest) as caught:
        parse_request(inputs, parameters)
    assert str(caught.value) == message


# ---- response building ------------------------------------------------------------------------------------
def step(text, token_ids, finished=False, total=0, nfe=0):
    return StepOutput(request_id="r", token_ids=token_ids, text=text, finished=finished,
                      finish_reason=FinishReason.LENGTH if finished else None, num_prompt_tokens=5,
                      num_output_tokens=total, nfe=nfe)


def decoded(arrays, name):
    return arrays[name].reshape(-1)[0].decode()


def test_streaming_sends_each_delta_and_the_requested_counts_only_at_the_end():
    request = parse_request({"text_input": text("hi"), "stream": flag(True), "return_finish_reason": flag(True),
                             "return_num_output_tokens": flag(True), "return_nfe": flag(True)})
    assembler = ResponseAssembler(request, prompt_text=lambda: "hi")
    first = assembler.add(step("ab", [97, 98], total=2, nfe=3))
    last = assembler.add(step("c", [99], finished=True, total=3, nfe=4))
    assert decoded(first, "text_output") == "ab" and first["output_ids"].tolist() == [[97, 98]]
    assert set(first) == {"text_output", "output_ids"}
    assert decoded(last, "text_output") == "c" and last["output_ids"].tolist() == [[99]]
    assert decoded(last, "finish_reason") == "length"
    assert last["num_output_tokens"].tolist() == [[3]] and last["nfe"].tolist() == [[4]]
    assert last["nfe"].dtype == np.uint32 and "num_input_tokens" not in last


def test_non_streaming_sends_one_response_with_the_prompt_unless_excluded():
    for exclude, expected in ((False, "hi abc"), (True, "abc")):
        request = parse_request({"text_input": text("hi "), "exclude_input_in_output": flag(exclude),
                                 "return_num_input_tokens": flag(True)})
        assembler = ResponseAssembler(request, prompt_text=lambda: "hi ")
        assert assembler.add(step("ab", [97, 98], total=2)) is None
        arrays = assembler.add(step("c", [99], finished=True, total=3))
        assert decoded(arrays, "text_output") == expected
        assert arrays["output_ids"].tolist() == [[97, 98, 99]]
        assert arrays["num_input_tokens"].tolist() == [[5]]


# ---- engine settings --------------------------------------------------------------------------------------
def parameters(**values):
    return {key: {"string_value": value} for key, value in values.items()}


def test_engine_settings_convert_types_and_resolve_the_model_path(tmp_path):
    settings = engine_settings(parameters(model="demo", block_size="8", accept_threshold="0.75",
                                          enforce_eager="true", num_kv_pages="", decoding_strategy="d2f"),
                               model_dir=tmp_path)
    assert settings == {"model": str(tmp_path / "demo"), "block_size": 8, "accept_threshold": 0.75,
                        "enforce_eager": True, "decoding_strategy": "d2f"}
    assert engine_settings(parameters(model="/abs/ckpt"), tmp_path)["model"] == "/abs/ckpt"


@pytest.mark.parametrize("values, message", [
    ({"model": "m", "blok_size": "8"}, "unknown parameter 'blok_size' in config.pbtxt; known parameters: "),
    ({"model": "m", "block_size": "eight"}, "parameter 'block_size' in config.pbtxt must be an integer, got 'eight'"),
    ({"model": "m", "enforce_eager": "maybe"}, "parameter 'enforce_eager' in config.pbtxt must be true or false, "
                                               "got 'maybe'"),
    ({"model": "m", "block_size": ""}, "parameter 'block_size' in config.pbtxt needs a value"),
    ({"block_size": "8"}, "parameter 'model' in config.pbtxt must name a checkpoint directory"),
])
def test_bad_engine_setting_names_the_parameter(tmp_path, values, message):
    with pytest.raises(ValueError) as caught:
        engine_settings(parameters(**values), tmp_path)
    assert str(caught.value).startswith(message)
