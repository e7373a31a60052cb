"""Every integer a request can carry, just inside and just past the type it is documented to take, through a real
server. The generate endpoint writes a JSON number under "parameters" into the input tensor of that name in the
tensor's type; the model declares its integer inputs INT64 (random_seed UINT64), so a number reaches the model as
sent and one the engine cannot represent is refused by name, never served as another value (an INT32 input once
served max_tokens 2^32 + 1 as 1, and input id 2^32 + 49 as token 49). Past 64 bits Triton's own JSON reading
refuses the body (HTTP 500) before the model sees it."""

import json

import numpy as np
import pytest
from served import generate, grpc_inputs, grpc_stream, ids, post, reference, tensor
from tritonclient.utils import InferenceServerException

from diffulex_backend.testing.checkpoint import TOKENIZER_VOCAB_SIZE

INT32_MAX, INT64_MAX, UINT64_MAX = 2**31 - 1, 2**63 - 1, 2**64 - 1
GOOD = {"max_tokens": 8, "temperature": 0}
VOCAB = TOKENIZER_VOCAB_SIZE


def answer(server, body: dict) -> tuple[int, str]:
    status, payload = post(f"{server.http_url}/v2/models/diffulex/generate", body)
    decoded = json.loads(payload)
    return status, decoded.get("error", "")


def range_message(name: str, low: int, value: int, extra: str = "") -> str:
    return f"sampling parameter '{name}' must be an integer in [{low}, {INT32_MAX}]{extra}, got {value}"


@pytest.mark.parametrize("parameters, message", [
    ({"max_tokens": INT32_MAX}, f"max_tokens is {INT32_MAX}: "),  # reaches the model as sent; too long to serve
    ({"max_tokens": INT32_MAX + 1}, range_message("max_tokens", 1, INT32_MAX + 1)),
    ({"max_tokens": 2**32 + 1}, range_message("max_tokens", 1, 2**32 + 1)),  # once served as max_tokens 1
    ({"max_tokens": INT64_MAX}, range_message("max_tokens", 1, INT64_MAX)),
    ({"max_tokens": -1}, range_message("max_tokens", 1, -1)),
    ({"max_tokens": 8, "min_length": INT32_MAX + 1}, range_message("min_tokens", 0, INT32_MAX + 1)),
    ({"max_tokens": 8, "top_k": INT32_MAX + 1}, range_message("top_k", 0, INT32_MAX + 1, " (0 disables it)")),
    ({"max_tokens": 8, "top_k": -1}, range_message("top_k", 0, -1, " (0 disables it)")),
    ({"max_tokens": 8, "end_id": INT32_MAX}, f"'stop_token_ids' holds {INT32_MAX}, outside the vocabulary"),
    ({"max_tokens": 8, "end_id": 2**32 + 54},  # once acted as stop token 54
     f"'stop_token_ids' must be a list of at most 1024 token ids in [0, {INT32_MAX}], got [{2**32 + 54}]"),
    ({"max_tokens": 8, "beam_width": 2**32 + 1}, "input 'beam_width' must be 1"),  # once wrapped to 1
    ({"max_tokens": 8, "seed": UINT64_MAX + 1}, f"must be an integer in [0, {UINT64_MAX}] or null"),
    # Triton's request parameters hold int64: a larger number arrives as a double, refused rather than rounded;
    # such a seed goes in random_seed (UINT64) or in sampling_parameters.
    ({"max_tokens": 8, "seed": UINT64_MAX}, "got 1.8446744073709552e+19"),
], ids=["max_tokens int32 max", "max_tokens int32 max + 1", "max_tokens 2^32 + 1", "max_tokens int64 max",
        "max_tokens -1", "min_length int32 max + 1", "top_k int32 max + 1", "top_k -1", "end_id int32 max",
        "end_id 2^32 + 54", "beam_width 2^32 + 1", "seed 2^64", "seed parameter uint64 max"])
def test_an_integer_the_engine_cannot_take_is_refused_by_name_and_never_wrapped(server, engine, parameters, message):
    status, error = answer(server, {"text_input": "12+34=", "parameters": parameters})
    assert status == 400 and message in error, error
    (expected,) = reference(engine, ["hello"], **GOOD)
    assert ids(generate(server, {"text_input": "hello", "parameters": GOOD,
                                 "exclude_input_in_output": True})["output_ids"]) == expected.token_ids


@pytest.mark.parametrize("parameters", [{"top_k": INT32_MAX}, {"random_seed": UINT64_MAX}, {"seed": INT64_MAX},
                                        {"min_length": 8}, {"beam_width": 1}],
                         ids=["top_k int32 max", "random_seed uint64 max", "seed parameter int64 max", "min_length",
                              "beam_width 1"])
def test_an_integer_at_its_types_limit_is_served_as_sent(server, engine, parameters):
    params = {**GOOD, "temperature": 1.0}
    status, payload = post(f"{server.http_url}/v2/models/diffulex/generate",
                           {"text_input": "hello", "parameters": {**params, **parameters},
                            "exclude_input_in_output": True})
    assert status == 200, payload
    engine_params = {"top_k": parameters.get("top_k", 0), "min_tokens": parameters.get("min_length", 0),
                     "seed": parameters.get("random_seed", parameters.get("seed"))}
    (expected,) = reference(engine, ["hello"], **params, **engine_params)
    if engine_params["seed"] is not None:  # seeded: the same tokens as the engine draws
        assert ids(json.loads(payload)["output_ids"]) == expected.token_ids


@pytest.mark.parametrize("body", [{"max_tokens": UINT64_MAX + 1}, {"random_seed": UINT64_MAX + 1},
                                  {"end_id": INT64_MAX + 1}], ids=["max_tokens 2^64", "random_seed 2^64",
                                                                   "end_id 2^63"])
def test_a_number_past_64_bits_is_refused_by_triton_before_the_model(server, engine, body):
    status, error = answer(server, {"text_input": "hello", "parameters": {**GOOD, **body}})
    assert status == 500 and "Unable to parse 'data'" in error, error
    (expected,) = reference(engine, ["hello"], **GOOD)
    assert ids(generate(server, {"text_input": "hello", "parameters": GOOD,
                                 "exclude_input_in_output": True})["output_ids"]) == expected.token_ids


@pytest.mark.parametrize("token", [VOCAB, INT32_MAX, 2**32 + 49, INT64_MAX, -1],
                         ids=["vocabulary size", "int32 max", "2^32 + 49", "int64 max", "-1"])
def test_an_input_id_outside_the_vocabulary_is_refused_over_http_and_grpc(server, token):
    status, error = answer(server, {"input_ids": [5, token, 7], "parameters": GOOD})
    assert status == 400 and error == f"prompt token id {token} is out of range [0, {VOCAB})", error
    with pytest.raises(InferenceServerException) as caught:
        grpc_stream(server, [tensor("input_ids", np.array([[5, token, 7]], dtype=np.int64))])
    assert caught.value.message() == f"prompt token id {token} is out of range [0, {VOCAB})"


def test_grpc_clients_send_the_integer_inputs_as_int64(server, engine):
    inputs = grpc_inputs("hello", {"temperature": 0}, exclude_input_in_output=True)
    inputs.append(tensor("max_tokens", np.array([[8]], dtype=np.int64)))
    results = grpc_stream(server, inputs)
    (expected,) = reference(engine, ["hello"], **GOOD)
    tokens = [r.as_numpy("output_ids") for r in results]
    assert [t for array in tokens if array is not None for t in array.reshape(-1).tolist()] == expected.token_ids
    with pytest.raises(InferenceServerException) as caught:
        grpc_stream(server, [*grpc_inputs("hello", {}), tensor("max_tokens", np.array([[8]], dtype=np.int32))])
    assert "expects 'INT64'" in caught.value.message()
