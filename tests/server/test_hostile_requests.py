"""What one client sends cannot take the model down for the others: every class of hostile input is refused alone,
with its reason, through the real server, and the model keeps serving with its health true."""

import json
import queue
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from served import cpu_seconds, generate, grpc_inputs, grpc_stream, ids, metrics, post, reference, stub_pids, tensor, wait_for
from tritonclient.utils import InferenceServerException

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID, MASK_TOKEN_ID

GOOD = {"max_tokens": 8, "temperature": 0}


def generate_url(server) -> str:
    return f"{server.http_url}/v2/models/diffulex/generate"


def refused(server, body: dict) -> str:
    status, payload = post(generate_url(server), body)
    assert status == 400, payload
    return json.loads(payload)["error"]


def assert_still_serving(server, engine) -> None:
    with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{server.http_url}/v2/models/diffulex/ready", timeout=10) as response:
        assert response.status == 200
    (expected,) = reference(engine, ["hello"], **GOOD)
    output = generate(server, {"text_input": "hello", "parameters": GOOD, "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids


def test_a_seed_past_int64_is_served_like_the_engine_serves_it(server, engine):
    """A uint64 seed once overflowed the int64 packing of the step and failed the engine for everyone."""
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 2**63}
    (expected,) = reference(engine, ["hello"], **params)
    output = generate(server, {"text_input": "hello", "sampling_parameters": json.dumps(params),
                               "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids
    assert_still_serving(server, engine)


@pytest.mark.parametrize("raw, message", [
    ('{"max_tokens": 8, "top_k": 9223372036854775808}',
     "sampling parameter 'top_k' must be an integer in [0, 2147483647] (0 disables it), got 9223372036854775808"),
    ('{"max_tokens": 8, "temperature": Infinity}', "Infinity is not a number a sampling parameter can take"),
    ('{"max_tokens": 8, "temperature": 1e39}',
     "sampling parameter 'temperature' must be a finite number in [0, 3.402823e+38], got 1e+39"),
    ('{"max_tokens": 8, "top_p": NaN}', "NaN is not a number a sampling parameter can take"),
    ('{"max_tokens": 8, "seed": 18446744073709551616}',
     "sampling parameter 'seed' must be an integer in [0, 18446744073709551615] or null, got 18446744073709551616"),
    ('{"max_tokens": 8, "stop_token_ids": [9223372036854775807]}',
     "sampling parameter 'stop_token_ids' must be a list of at most 1024 token ids in [0, 2147483647], "
     "got [9223372036854775807]"),
], ids=["top_k 2^63", "infinite temperature", "temperature past float32", "NaN top_p", "seed 2^64",
        "stop token past int32"])
def test_numbers_the_engine_cannot_represent_are_refused_and_the_model_keeps_serving(server, engine, raw, message):
    assert refused(server, {"text_input": "hi", "sampling_parameters": raw}) == f"input 'sampling_parameters': {message}"
    assert_still_serving(server, engine)


def test_deeply_nested_json_beside_31_good_requests_fails_only_itself(server, engine):
    prompts = [f"request {i}" for i in range(31)]
    expected = engine.generate(prompts, SamplingParams(**GOOD))
    nested = "[" * 30000 + "]" * 30000

    def send(i):
        if i == 31:
            return post(generate_url(server), {"text_input": "hi", "sampling_parameters": nested})
        return post(generate_url(server), {"text_input": prompts[i], "parameters": GOOD, "exclude_input_in_output": True})

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(send, range(32)))
    assert results[31][0] == 400
    assert json.loads(results[31][1]) == {"error": "input 'sampling_parameters' is nested more than 8 levels deep"}
    for (status, payload), want in zip(results[:31], expected):
        assert status == 200, payload
        assert ids(json.loads(payload)["output_ids"]) == want.token_ids
    assert_still_serving(server, engine)


def test_a_huge_prompt_is_refused_before_it_is_tokenized_and_stalls_no_one(server, engine):
    limit = 512 * engine.max_token_chars
    huge = "x" * 3_900_000  # under the 4 MB that Triton's HTTP front end takes
    (expected,) = reference(engine, ["hello"], max_tokens=40, temperature=0)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(generate, server, {"text_input": "hello", "parameters": {"max_tokens": 40, "temperature": 0},
                                              "exclude_input_in_output": True})
        bad = pool.submit(refused, server, {"text_input": huge, "parameters": {"max_tokens": 4}})
        assert bad.result() == f"prompt has 3900000 characters; at most {limit} can fit max_model_len (512) tokens"
        assert ids(good.result()["output_ids"]) == expected.token_ids


def test_input_ids_with_two_prompts_or_the_mask_token_are_refused(server, engine):
    with pytest.raises(InferenceServerException) as caught:
        grpc_stream(server, [tensor("input_ids", np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int64))])
    assert caught.value.message() == "input 'input_ids' must hold one prompt, of shape [N] or [1, N]; got [2, 3]"
    with pytest.raises(InferenceServerException) as caught:
        grpc_stream(server, grpc_inputs([5, MASK_TOKEN_ID, 7], GOOD))
    assert caught.value.message() == (f"prompt holds the mask token ({MASK_TOKEN_ID}) at position 1; the engine "
                                      "decodes masked positions only in the generation area")
    assert_still_serving(server, engine)


def test_parameters_and_sampling_parameters_merge_with_sampling_parameters_winning(server, engine):
    (expected,) = reference(engine, ["hello"], max_tokens=8, temperature=1.0, seed=3)
    output = generate(server, {"text_input": "hello", "exclude_input_in_output": True,
                               "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 1.0}),
                               "parameters": {"max_tokens": 99, "seed": 3}})
    assert ids(output["output_ids"]) == expected.token_ids


def test_string_numbers_under_parameters_convert_where_the_model_reads_them(server, engine):
    """As README.md says: a string under the generate endpoint's "parameters" is converted when the key names a
    sampling parameter only (the model reads it), and answered by Triton itself when it names a tensor input."""
    (expected,) = reference(engine, ["hello"], max_tokens=8, min_tokens=8, temperature=1.0, seed=3)
    output = generate(server, {"text_input": "hello", "exclude_input_in_output": True,
                               "parameters": {"max_tokens": 8, "min_tokens": "8", "temperature": 1.0, "seed": "3"}})
    assert ids(output["output_ids"]) == expected.token_ids
    status, payload = post(generate_url(server), {"text_input": "hello", "parameters": {"max_tokens": "16"}})
    assert status == 500 and b"non-signed-integer" in payload, payload
    assert_still_serving(server, engine)


def test_genai_perf_clients_of_both_backends_are_served(server, engine):
    """genai-perf --backend vllm sends string values; --backend tensorrtllm sends TensorRT-LLM's tensor inputs."""
    (expected,) = reference(engine, ["hello"], max_tokens=8, temperature=0)
    vllm_style = generate(server, {"text_input": "hello", "exclude_input_in_output": True,
                                   "sampling_parameters": json.dumps({"max_tokens": "8", "temperature": "0"})})
    trtllm_style = generate(server, {"text_input": "hello", "exclude_input_in_output": True, "max_tokens": 8,
                                     "temperature": 0.0, "beam_width": 1, "stop_words": [""]})
    assert ids(vllm_style["output_ids"]) == ids(trtllm_style["output_ids"]) == expected.token_ids


def test_the_idle_model_uses_no_cpu(server):
    generate(server, {"text_input": "hello", "parameters": GOOD})  # the loop has run, then gone idle
    (pid,) = stub_pids(server, "diffulex")
    time.sleep(1.0)
    before = cpu_seconds(pid)
    time.sleep(3.0)
    assert cpu_seconds(pid) - before < 0.15  # 5% of one core; a busy loop burns 3 s here


def test_a_refused_request_over_grpc_streaming_leaves_the_stream_usable(server, engine):
    """One bad request on a client's stream does not end the stream: the next request on it is served."""
    (expected,) = reference(engine, ["hello"], **GOOD)
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("diffulex", grpc_inputs("hi", {"max_tokens": 8, "temperature": float("inf")}))
        _, error = responses.get(timeout=60)
        assert error is not None and "Infinity is not a number" in error.message()
        client.async_stream_infer("diffulex", grpc_inputs("hello", GOOD))
        result, error = responses.get(timeout=60)
        assert error is None
        assert result.as_numpy("output_ids").reshape(-1).tolist() == expected.token_ids
        client.stop_stream()
    wait_for(lambda: metrics(server)["diffulex_kv_pages_used"] == 0)


def test_a_ban_of_every_token_and_a_key_given_twice_beside_good_requests_fail_only_themselves(server, engine):
    """min_tokens bans the stop and EOS ids from the first positions, and the mask token is never sampled: stop ids
    that leave no other token, EOS counted unless ignored, are refused by name, as is a key given twice, while
    eight good requests beside them get their tokens; one token left unbanned is served, and takes the banned
    positions."""
    vocab = engine.model.arch.vocab_size
    every = [t for t in range(vocab) if t != MASK_TOKEN_ID]
    but_eos = [t for t in every if t != EOS_TOKEN_ID]
    ban = "sampling parameter 'stop_token_ids' leaves no token to sample under min_tokens ({})"
    bad = [
        (json.dumps({"max_tokens": 8, "min_tokens": 8, "logprobs": 1, "stop_token_ids": every}), ban.format(8)),
        (json.dumps({"max_tokens": 8, "min_tokens": 1, "stop_token_ids": but_eos}), ban.format(1)),  # EOS: the last
        (json.dumps({"max_tokens": 4, "min_tokens": 4, "stop_token_ids": list(range(vocab))}), ban.format(4)),
        ('{"max_tokens": 8, "max_tokens": 8}',
         "input 'sampling_parameters': the key 'max_tokens' is given more than once"),
        ('{"temperature": 0, "stop": ["a"], "temperature": 1}',
         "input 'sampling_parameters': the key 'temperature' is given more than once"),
    ]
    prompts = [f"request {i}" for i in range(8)]
    expected = engine.generate(prompts, SamplingParams(**GOOD))

    def send(i):
        if i < len(bad):
            return post(generate_url(server), {"text_input": "hi", "sampling_parameters": bad[i][0]})
        return post(generate_url(server), {"text_input": prompts[i - len(bad)], "parameters": GOOD,
                                           "exclude_input_in_output": True})

    with ThreadPoolExecutor(len(bad) + len(prompts)) as pool:
        results = list(pool.map(send, range(len(bad) + len(prompts))))
    for (status, payload), (_, message) in zip(results, bad):
        assert status == 400, payload
        assert message in json.loads(payload)["error"]
    for (status, payload), want in zip(results[len(bad):], expected):
        assert status == 200, payload
        assert ids(json.loads(payload)["output_ids"]) == want.token_ids
    left = generate(server, {"text_input": "hi", "exclude_input_in_output": True, "sampling_parameters": json.dumps(
        {"max_tokens": 8, "min_tokens": 4, "ignore_eos": True, "stop_token_ids": but_eos})})
    assert ids(left["output_ids"])[:4] == [EOS_TOKEN_ID] * 4
    assert_still_serving(server, engine)


def test_triton_request_settings_are_refused_on_the_generate_endpoint_and_served_over_grpc(server, engine):
    """Triton's generate endpoint hands `timeout`, `priority` and the sequence settings to the model as plain
    parameters and acts on none of them: each is refused by name, under "parameters" or at the top level, rather
    than ignored. A gRPC infer request carries them to Triton, which reads them and passes them on to no model: it is
    served. `binary_data_output`, which both pass on and which changes neither, is taken and left unread (shown
    through generate: tritonclient refuses to send it over gRPC itself, and the model reads it the same way from
    either)."""
    for key, value in (("timeout", 10**8), ("priority", 1), ("sequence_id", 7), ("sequence_start", True),
                       ("sequence_end", False)):
        for body in ({"text_input": "hi", "parameters": {**GOOD, key: value}}, {"text_input": "hi", key: value}):
            assert refused(server, body) == (
                f"request parameter '{key}' is a Triton request setting, which the generate endpoint passes to the "
                "model without acting on it; Triton reads it from a gRPC infer request")
    (expected,) = reference(engine, ["hello"], **GOOD)
    output = generate(server, {"text_input": "hello", "parameters": {**GOOD, "binary_data_output": True},
                               "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("diffulex", grpc_inputs("hello", GOOD), priority=1, timeout=10**8)
        result, error = responses.get(timeout=60)
        assert error is None, error
        assert result.as_numpy("output_ids").reshape(-1).tolist() == expected.token_ids
        client.stop_stream()
    assert_still_serving(server, engine)
