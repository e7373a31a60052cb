"""The OpenAI request as the model's Triton requests, without a server: which inputs, which sampling parameters, the
seeds of n copies and the bounds that protect the server; and the model's errors sorted into HTTP statuses."""

import json

import pytest

from diffulex_backend.scheduler import non_finite_message
from diffulex_backend.serving.request_parsing import MAX_JSON_DEPTH, MAX_PARAMETERS_CHARS, json_depth
from diffulex_client.openai_front.adapter import MAX_CHOICES, SEED_MODULUS, completion_prompts, triton_requests
from diffulex_client.openai_front.errors import OpenAIError
from diffulex_client.openai_front.schemas import ChatCompletionRequest, CompletionRequest
from diffulex_client.openai_front.triton_stream import ErrorClass, classify_error


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "diffulex", "prompt": "hi", **fields})


def test_openai_fields_and_extra_fields_become_the_models_sampling_parameters():
    request = completion(max_tokens=7, temperature=0.5, top_p=0.9, stop="x", seed=3, min_tokens=2, lora_name="math",
                         profile_steps=4)
    (choice,) = triton_requests(request, completion_prompts(request))
    assert choice.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop": ["x"], "seed": 3,
                               "min_tokens": 2, "lora_name": "math", "profile_steps": 4}


def test_max_completion_tokens_wins_over_max_tokens():
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 5, "max_completion_tokens": 9})
    (choice,) = triton_requests(chat, [[1, 2]])
    assert choice.sampling["max_tokens"] == 9


def test_n_copies_take_seed_plus_i_modulo_two_to_the_64_and_index_by_prompt():
    request = completion(prompt=["a", "b"], n=3, seed=2**64 - 2)
    choices = triton_requests(request, completion_prompts(request))
    assert [(c.index, c.prompt, c.sampling["seed"]) for c in choices] == [
        (0, "a", 2**64 - 2), (1, "a", 2**64 - 1), (2, "a", 0), (3, "b", 2**64 - 2), (4, "b", 2**64 - 1), (5, "b", 0)]


def test_a_negative_int64_seed_wraps_and_a_seed_out_of_range_is_refused():
    assert triton_requests(completion(seed=-1), ["hi"])[0].sampling["seed"] == SEED_MODULUS - 1
    with pytest.raises(OpenAIError) as caught:
        triton_requests(completion(seed=2**64), ["hi"])
    assert caught.value.param == "seed"


def test_requests_without_a_seed_get_random_seeds_that_differ():
    seeds = {triton_requests(completion(), ["hi"])[0].sampling["seed"] for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= seed < SEED_MODULUS for seed in seeds)


def test_text_goes_as_text_input_and_token_ids_as_input_ids_with_the_flags():
    (text,) = triton_requests(completion(stream=True), ["hi"])
    (ids,) = triton_requests(completion(), [[5, 6, 7]])
    text_inputs = {tensor.name(): tensor for tensor in text.inputs()}
    assert set(text_inputs) == {"text_input", "sampling_parameters", "stream", "return_finish_reason",
                                "return_num_input_tokens", "return_num_output_tokens", "exclude_input_in_output"}
    assert text_inputs["text_input"].datatype() == "BYTES" and text_inputs["stream"].datatype() == "BOOL"
    id_inputs = {tensor.name(): tensor for tensor in ids.inputs()}
    assert "text_input" not in id_inputs
    assert (id_inputs["input_ids"].datatype(), id_inputs["input_ids"].shape()) == ("INT32", [1, 3])
    assert json.loads(ids.sampling_json()) == ids.sampling
    # A model whose config declares INT64 token ids gets them as INT64.
    wide = {tensor.name(): tensor for tensor in ids.inputs("INT64")}["input_ids"]
    assert wide.datatype() == "INT64"


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"prompt": ["x"] * 65}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"), ({"prompt": [2**31]}, "prompt"),
    ({"prompt": ["x"] * 3, "n": MAX_CHOICES // 2}, "n"),
])
def test_bounds_are_400s_naming_the_field(fields, param):
    request = completion(**fields)
    with pytest.raises(OpenAIError) as caught:
        triton_requests(request, completion_prompts(request))
    assert (caught.value.status, caught.value.param) == (400, param)


def test_sampling_parameters_at_the_models_bounds_pass_and_one_past_them_are_refused_by_their_field():
    """Depth: the model takes 8 levels, the object that holds the parameters included. Size: 65536 characters of
    JSON with the largest seed; every copy's JSON, whatever its seed, then fits."""
    def nested(depth):
        return [nested(depth - 1)] if depth > 1 else [1]

    for depth, refused in ((7, False), (8, True)):
        request = completion(stop_token_ids=nested(depth))  # the object is the 8th or 9th level
        if refused:
            with pytest.raises(OpenAIError) as caught:
                triton_requests(request, completion_prompts(request))
            assert (caught.value.status, caught.value.param) == (400, "stop_token_ids")
        else:
            (choice,) = triton_requests(request, completion_prompts(request))
            assert json_depth(choice.sampling_json()) == MAX_JSON_DEPTH
    base = len(json.dumps({"stop": [""], "seed": SEED_MODULUS - 1}))
    fitting = completion(stop="x" * (MAX_PARAMETERS_CHARS - base), n=3, seed=SEED_MODULUS - 2)
    assert all(len(choice.sampling_json()) <= MAX_PARAMETERS_CHARS
               for choice in triton_requests(fitting, completion_prompts(fitting)))
    past = completion(stop="x" * (MAX_PARAMETERS_CHARS - base + 1))
    with pytest.raises(OpenAIError) as caught:
        triton_requests(past, completion_prompts(past))
    assert (caught.value.status, caught.value.param) == (400, "stop")


@pytest.mark.parametrize("message, kind", [
    ("input 'sampling_parameters': sampling parameter 'top_k' must be an integer", ErrorClass.BAD_REQUEST),
    # A refusal that quotes the client's own text, which reads like an outage, is still the request's fault.
    ("input 'sampling_parameters': sampling parameter 'confidence' must be one of ['margin', 'neg_entropy', "
     "'prob'], got 'is not ready'", ErrorClass.BAD_REQUEST),
    ("request parameters: sampling parameter 'stop' got 'the engine failed'", ErrorClass.BAD_REQUEST),
    ("sampling parameter 'lora_name' is 'is not ready', which names no adapter; registered: []",
     ErrorClass.BAD_REQUEST),
    ("prompt has 9000 characters; at most 8192 are accepted", ErrorClass.BAD_REQUEST),
    ("request needs up to 80 KV pages but the cache has 64", ErrorClass.BAD_REQUEST),
    ("prompt has 4 tokens and max_tokens is 3000: 4 + 3000 = 3004 exceeds max_model_len (512)", ErrorClass.BAD_REQUEST),
    ("the server is shutting down or unloading this model", ErrorClass.UNAVAILABLE),
    ("the engine failed and this model can no longer serve: RuntimeError: x", ErrorClass.UNAVAILABLE),
    ("Request for unknown model: 'diffulex' is not found", ErrorClass.UNAVAILABLE),
    ("building the response failed: KeyError: 'x'", ErrorClass.INTERNAL),
    (non_finite_message("huge"), ErrorClass.INTERNAL),
    ("RuntimeError: CUDA error", ErrorClass.INTERNAL),
])
def test_triton_errors_are_sorted_into_the_requests_fault_unavailability_and_internal_faults(message, kind):
    assert classify_error(message) is kind
