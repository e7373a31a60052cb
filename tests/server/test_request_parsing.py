"""Request parsing, response building and engine settings: the serving rules, checked without a server."""

import json

import numpy as np
import pytest

from diffulex_backend import FinishReason, SamplingParams, StepOutput
from diffulex_backend.serving.engine_settings import engine_settings
from diffulex_backend.serving.request_parsing import BadRequest, parse_request
from diffulex_backend.serving.response_building import LOGPROB_FLOOR, ResponseAssembler


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
    parsed = parse_request({"input_ids": np.array([[5, 6, 7]], dtype=np.int64)})
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
    ({}, "", "missing prompt: send 'text_input' (a string) or 'input_ids' (INT64 token ids)"),
    ({"text_input": text("")}, "", "input 'text_input' is empty"),
    ({"text_input": text("a"), "input_ids": np.array([[1]], dtype=np.int64)}, "",
     "send either 'text_input' or 'input_ids', not both"),
    ({"input_ids": np.zeros((1, 0), dtype=np.int64)}, "", "input 'input_ids' is empty"),
    ({"input_ids": np.array([[1.0]], dtype=np.float32)}, "", "input 'input_ids' must be INT64, got float32"),
    ({"text_input": text("a"), "stream": np.array([[1]], dtype=np.int64)}, "",
     "input 'stream' must be BOOL, got int64"),
    ({"text_input": text("a"), "sampling_parameters": text("{max_tokens: 3")}, "",
     "input 'sampling_parameters' is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    ({"text_input": text("a"), "sampling_parameters": text("[1, 2]")}, "",
     "input 'sampling_parameters' must be a JSON object, got list"),
    ({"text_input": text("a")}, '{"max_token": 3}',
     "request parameters: unknown sampling parameter(s) ['max_token']; allowed: "
     f"{SamplingParams.field_names()}"),
    ({"text_input": text("a")}, '{"max_tokens": 3, "timeout": 1000}',
     "request parameter 'timeout' is a Triton request setting, which the generate endpoint passes to the model "
     "without acting on it; Triton reads it from a gRPC infer request"),
    ({"text_input": text("a"), "sampling_parameters": text('{"max_tokens": -1}')}, "",
     "input 'sampling_parameters': sampling parameter 'max_tokens' must be an integer in [1, 2147483647], got -1"),
    ({"text_input": text("a"), "sampling_parameters": text('{"temperature": "hot"}')}, "",
     "input 'sampling_parameters': sampling parameter 'temperature' must be a finite number in [0, 3.402823e+38], "
         "got 'hot'"),
])
def test_bad_request_names_the_bad_field(inputs, parameters, message):
    with pytest.raises(BadRequest) as caught:
        parse_request(inputs, parameters)
    assert str(caught.value) == message


# Every number at its type's limits, non-finite floats, wrong types: refused at parse time, naming the field.
@pytest.mark.parametrize("values, message", [
    ({"seed": 2**64}, "sampling parameter 'seed' must be an integer in [0, 18446744073709551615] or null, "
                      "got 18446744073709551616"),
    ({"seed": -1}, "sampling parameter 'seed' must be an integer in [0, 18446744073709551615] or null, got -1"),
    ({"top_k": 2**63}, "sampling parameter 'top_k' must be an integer in [0, 2147483647] (0 disables it), "
                       "got 9223372036854775808"),
    ({"max_tokens": 2**31}, "sampling parameter 'max_tokens' must be an integer in [1, 2147483647], got 2147483648"),
    ({"steps": 0}, "sampling parameter 'steps' must be an integer in [1, 2147483647] or null, got 0"),
    ({"temperature": 1e39}, "sampling parameter 'temperature' must be a finite number in [0, 3.402823e+38], got 1e+39"),
    ({"temperature": 10**400}, "sampling parameter 'temperature' must be a finite number in [0, 3.402823e+38], got "
                               "1" + "0" * 59 + "... (401 characters)"),
    ({"top_p": 0}, "sampling parameter 'top_p' must be a number in (0, 1], got 0"),
    ({"accept_threshold": 1.5}, "sampling parameter 'accept_threshold' must be a number in [0, 1] or null, got 1.5"),
    ({"stop_token_ids": [2**31]}, "sampling parameter 'stop_token_ids' must be a list of at most 1024 token ids in "
                                  "[0, 2147483647], got [2147483648]"),
    ({"stop": ["x"] * 65}, "sampling parameter 'stop' must be a list of at most 64 non-empty strings, got "
                           "['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x',... (325 characters)"),
    ({"min_tokens": 9, "max_tokens": 8}, "sampling parameter 'min_tokens' must be at most max_tokens (8), got 9"),
    ({"confidence": ["prob"]}, "sampling parameter 'confidence' must be one of ['margin', 'neg_entropy', 'prob'], "
                               "got ['prob']"),
])
def test_out_of_range_sampling_parameter_is_refused_at_parse_time(values, message):
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("a"), "sampling_parameters": text(json.dumps(values))})
    assert str(caught.value) == f"input 'sampling_parameters': {message}"


@pytest.mark.parametrize("raw", ['{"temperature": Infinity}', '{"temperature": -Infinity}', '{"top_p": NaN}'])
def test_json_infinity_and_nan_are_refused(raw):
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("a"), "sampling_parameters": text(raw)})
    assert str(caught.value).startswith("input 'sampling_parameters': ")
    assert "is not a number a sampling parameter can take" in str(caught.value)


def test_a_key_given_twice_is_refused_by_name():
    """JSON keeps the last of two values of a key; a client that sent two meant one of them, and is told which key."""
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("a"), "sampling_parameters": text('{"max_tokens": 4, "max_tokens": 5}')})
    assert str(caught.value) == "input 'sampling_parameters': the key 'max_tokens' is given more than once"
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("a")}, '{"seed": 1, "stop": ["a"], "seed": 2}')
    assert str(caught.value) == "request parameters: the key 'seed' is given more than once"


def test_deeply_nested_json_is_refused_without_recursing():
    raw = "[" * 100000 + "]" * 100000
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("a")}, '{"stop": ' + raw[:60000] + "}")
    assert str(caught.value) == "request parameters is nested more than 8 levels deep"
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("a"), "sampling_parameters": text(raw)})
    assert str(caught.value) == "input 'sampling_parameters' has 200000 characters; at most 65536 are accepted"


def test_brackets_inside_strings_do_not_count_as_nesting():
    parsed = parse_request({"text_input": text("a"), "sampling_parameters": text(json.dumps({"stop": ["[[[[[[[[[[{"]}))})
    assert parsed.params.stop == ["[[[[[[[[[[{"]


@pytest.mark.parametrize("shape", [(2, 3), (1, 1, 3)])
def test_input_ids_holding_more_than_one_prompt_are_refused(shape):
    with pytest.raises(BadRequest) as caught:
        parse_request({"input_ids": np.ones(shape, dtype=np.int64)})
    assert str(caught.value) == f"input 'input_ids' must hold one prompt, of shape [N] or [1, N]; got {list(shape)}"


def test_string_values_are_converted_as_the_vllm_backend_does():
    """genai-perf --backend vllm sends every value as a string."""
    parsed = parse_request({"text_input": text("a"), "sampling_parameters": text(
        '{"max_tokens": "16", "min_tokens": "16", "temperature": "0.5", "ignore_eos": "true", "seed": "7"}')})
    assert parsed.params == SamplingParams(max_tokens=16, min_tokens=16, temperature=0.5, ignore_eos=True, seed=7)


def test_request_parameters_and_sampling_parameters_merge_key_by_key():
    parsed = parse_request({"text_input": text("hi"), "sampling_parameters": text('{"max_tokens": 4}')},
                           json.dumps({"max_tokens": 9, "seed": 3}))
    assert (parsed.params.max_tokens, parsed.params.seed) == (4, 3)
    parsed = parse_request({"text_input": text("hi"), "sampling_parameters": text('{"max_tokens": 4}'),
                            "max_tokens": np.array([[9]], dtype=np.int64)})
    assert parsed.params.max_tokens == 4


def test_tensorrt_llm_tensor_inputs_set_sampling_parameters_over_request_parameters():
    """genai-perf --backend tensorrtllm and TensorRT-LLM clients send these as tensors."""
    parsed = parse_request({
        "text_input": text("hi"),
        "max_tokens": np.array([[32]], dtype=np.int64), "min_length": np.array([[8]], dtype=np.int64),
        "temperature": np.array([[0.5]], dtype=np.float32), "top_k": np.array([[5]], dtype=np.int64),
        "top_p": np.array([[0.75]], dtype=np.float32), "random_seed": np.array([[2**63]], dtype=np.uint64),
        "end_id": np.array([[2]], dtype=np.int64), "stop_words": np.array([[b"\n\n", b""]], dtype=np.object_),
        "beam_width": np.array([[1]], dtype=np.int64),
    }, json.dumps({"max_tokens": 4, "temperature": 0.1}))
    assert parsed.params == SamplingParams(max_tokens=32, min_tokens=8, temperature=0.5, top_k=5, top_p=0.75,
                                           seed=2**63, stop_token_ids=[2], stop=["\n\n"])


def test_beam_search_is_refused():
    with pytest.raises(BadRequest) as caught:
        parse_request({"text_input": text("hi"), "beam_width": np.array([[4]], dtype=np.int64)})
    assert str(caught.value) == "input 'beam_width' must be 1: diffusion decoding has no beam search"


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


def test_adapter_paths_resolve_against_the_model_directory_like_the_model(tmp_path):
    settings = engine_settings(parameters(model="demo", lora_path="adapters/merged", pre_merge_lora="true",
                                          lora_modules="math=adapters/math, code=/abs/code"), tmp_path)
    assert settings["lora_path"] == str(tmp_path / "adapters/merged")
    assert settings["lora_modules"] == f"math={tmp_path / 'adapters/math'},code=/abs/code"


def test_the_python_backends_own_parameters_pass_beside_the_engine_settings(tmp_path):
    settings = engine_settings(parameters(model="demo", EXECUTION_ENV_PATH="$$TRITON_MODEL_DIRECTORY/env.tar.gz",
                                          FORCE_CPU_ONLY_INPUT_TENSORS="yes"), tmp_path)
    assert settings == {"model": str(tmp_path / "demo")}


@pytest.mark.parametrize("values, message", [
    ({"model": "m", "blok_size": "8"}, "unknown parameter 'blok_size' in config.pbtxt; known parameters: "),
    ({"model": "m", "FORCE_CPU_ONLY_INPUT_TENSORS": "no"},
     "parameter 'FORCE_CPU_ONLY_INPUT_TENSORS' in config.pbtxt must be 'yes', got 'no'"),
    ({"model": "m", "block_size": "1_000"}, "parameter 'block_size' in config.pbtxt must be an integer, got '1_000'"),
    ({"model": "m", "block_size": "\u0663"}, "parameter 'block_size' in config.pbtxt must be an integer, got '\u0663'"),
    ({"model": "m", "accept_threshold": "0_5"}, "parameter 'accept_threshold' in config.pbtxt must be a number, got "
                                                "'0_5'"),
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


def test_the_shipped_config_lists_every_engine_setting():
    """config.pbtxt is where a user finds the engine's settings: every Config field is there, and nothing else."""
    import re
    from pathlib import Path

    from diffulex_backend import Config

    text = (Path(__file__).resolve().parents[2] / "model_repository/diffulex/config.pbtxt").read_text()
    keys = re.findall(r'\{ key: "(\w+)", value: \{ string_value: "[^"]*" \} \}', text)
    assert sorted(keys) == sorted(Config.field_names())


# ---- log-probabilities ------------------------------------------------------------------------------------
def with_logprobs(output: StepOutput, logprobs: list[float], top: list[list[tuple[int, float]]] | None = None):
    output.logprobs = np.array(logprobs, dtype=np.float32)
    if top is not None:
        output.top_ids = np.array([[i for i, _ in row] for row in top], dtype=np.int64).reshape(len(top), -1)
        output.top_logprobs = np.array([[v for _, v in row] for row in top], dtype=np.float32).reshape(len(top), -1)
    return output


def test_return_log_probs_asks_the_engine_for_the_tokens_logprobs_and_logprobs_k_for_top_k():
    assert parse_request({"text_input": text("hi"), "return_log_probs": flag(True)}).params.logprobs == 0
    assert parse_request({"text_input": text("hi")}).params.logprobs is None
    parsed = parse_request({"text_input": text("hi"), "return_log_probs": flag(True),
                            "sampling_parameters": text('{"logprobs": "3"}')})
    assert parsed.params.logprobs == 3 and parsed.return_log_probs
    with pytest.raises(BadRequest, match="sampling parameter 'logprobs' must be an integer in \\[0, 20\\] or null"):
        parse_request({"text_input": text("hi"), "sampling_parameters": text('{"logprobs": 21}')})


def test_streamed_logprobs_come_with_their_tokens_in_tensorrt_llm_shapes():
    request = parse_request({"text_input": text("hi"), "stream": flag(True), "return_log_probs": flag(True)})
    assembler = ResponseAssembler(request, prompt_text=lambda: "hi")
    first = assembler.add(with_logprobs(step("ab", [97, 98], total=2), [-0.5, -0.25], [[(97, -0.5)], [(98, -0.25)]]))
    last = assembler.add(with_logprobs(step("c", [99], finished=True, total=3), [-1.0], [[(99, -1.0)]]))
    assert first["log_probs"].tolist() == [[-0.5, -0.25]] and first["log_probs"].dtype == np.float32
    assert first["output_log_probs"].tolist() == [[[-0.5, -0.25]]]
    assert first["cum_log_probs"].tolist() == [[-0.75]] and last["cum_log_probs"].tolist() == [[-1.75]]
    assert first["top_log_prob_ids"].tolist() == [[[97], [98]]] and first["top_log_prob_ids"].dtype == np.int32
    assert last["top_log_probs"].tolist() == [[[-1.0]]]


def test_a_whole_response_gathers_the_logprobs_and_a_request_that_did_not_ask_gets_none():
    request = parse_request({"text_input": text("hi"), "sampling_parameters": text('{"logprobs": 0}')})
    assembler = ResponseAssembler(request, prompt_text=lambda: "hi")
    assert assembler.add(with_logprobs(step("ab", [97, 98], total=2), [-0.5, -0.25])) is None
    arrays = assembler.add(with_logprobs(step("c", [99], finished=True, total=3), [-1.0]))
    assert arrays["log_probs"].tolist() == [[-0.5, -0.25, -1.0]] and arrays["cum_log_probs"].tolist() == [[-1.75]]
    assert "top_log_probs" not in arrays
    plain = ResponseAssembler(parse_request({"text_input": text("hi")}), prompt_text=lambda: "hi")
    assert not {"log_probs", "cum_log_probs"} & set(plain.add(step("c", [99], finished=True, total=1)))


def all_finite(arrays: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(array).all() for name, array in arrays.items() if array.dtype.kind == "f")


@pytest.mark.parametrize("stream", [True, False])
def test_a_token_that_could_not_be_sampled_is_sent_at_the_floor_and_no_array_holds_infinity(stream):
    request = parse_request({"text_input": text("hi"), "stream": flag(stream),
                             "sampling_parameters": text('{"logprobs": 2}')})
    assembler = ResponseAssembler(request, prompt_text=lambda: "hi")
    first = assembler.add(with_logprobs(step("a", [97], total=1), [-0.5], [[(97, -0.5), (3, float("-inf"))]]))
    last = assembler.add(with_logprobs(step("b", [98], finished=True, total=2), [float("-inf")],
                                       [[(98, float("-inf")), (4, float("-inf"))]]))
    arrays = [first, last] if stream else [last]
    assert all(all_finite(a) for a in arrays)
    assert last["top_log_probs"].tolist()[0][-1] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert last["log_probs"].tolist()[0][-1] == LOGPROB_FLOOR
    assert last["cum_log_probs"].tolist() == [[-0.5 + LOGPROB_FLOOR]]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("field", ["logprobs", "top_logprobs"])
def test_a_log_probability_that_is_nan_or_plus_infinity_is_never_put_in_a_response(field, value):
    """The engine ends such a request with an error before it answers; should one reach the response anyway, the
    response is not built (the request then ends with INTERNAL) rather than written as JSON no client can read."""
    request = parse_request({"text_input": text("hi"), "stream": flag(True),
                             "sampling_parameters": text('{"logprobs": 1}')})
    output = with_logprobs(step("a", [97], total=1), [-0.5], [[(97, -0.5)]])
    getattr(output, field)[0] = value
    with pytest.raises(ValueError, match="log-probabilities hold NaN or \\+inf: 1 of 1"):
        ResponseAssembler(request, prompt_text=lambda: "hi").add(output)
