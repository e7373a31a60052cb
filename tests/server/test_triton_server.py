"""The diffulex model in a real tritonserver, driven over HTTP (generate, SSE, metrics) and gRPC."""

import json
import queue
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_server import BAD_SETTINGS, FAST_DLLM_V2_SETTINGS, TEST_SETTINGS
from served import (decoded, generate, generate_stream, grpc_inputs, grpc_stream, ids, is_final, metrics, post,
                    reference, stub_pids, tensor, wait_for)
from tritonclient.utils import InferenceServerException

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.serving.engine_settings import engine_settings
from diffulex_backend.serving.stub_watchdog import MAX_RELOADS_AT_START

PROMPTS = ["12+34=", "the quick brown fox", "hello", "diffusion models decode in parallel"]
GREEDY = {"max_tokens": 12, "temperature": 0}  # three blocks of 4
ALL_COUNTS = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
              "return_nfe": True}
NON_FINITE_ERROR = ("decoding failed: the model's logits for this request hold NaN or infinite values under adapter "
                    "'huge', so its tokens would be noise")


# ---- generate and streaming -------------------------------------------------------------------------------
def test_http_generate_sends_one_response_equal_to_the_engine(server, engine):
    for prompt, expected in zip(PROMPTS, reference(engine, PROMPTS, **GREEDY)):
        output = generate(server, {"text_input": prompt, "parameters": GREEDY, "exclude_input_in_output": True,
                                   **ALL_COUNTS})
        assert output["text_output"] == expected.text
        assert ids(output["output_ids"]) == expected.token_ids
        assert output["finish_reason"] == expected.finish_reason.value
        assert output["num_input_tokens"] == len(expected.prompt_token_ids)
        assert output["num_output_tokens"] == len(expected.token_ids)
        assert output["nfe"] == expected.nfe


def test_http_generate_includes_the_prompt_unless_excluded(server, engine):
    (expected,) = reference(engine, ["hello"], **GREEDY)
    assert generate(server, {"text_input": "hello", "parameters": GREEDY})["text_output"] == "hello" + expected.text


def test_sse_events_concatenate_to_the_generate_text(server):
    body = {"text_input": PROMPTS[1], "parameters": GREEDY, "exclude_input_in_output": True}
    whole = generate(server, body)
    events = generate_stream(server, {**body, "stream": True, "return_finish_reason": True})
    assert len(events) >= 2
    assert "".join(event["text_output"] for event in events) == whole["text_output"]
    assert sum((ids(event["output_ids"]) for event in events), []) == ids(whole["output_ids"])
    assert [event.get("finish_reason") for event in events] == [None] * (len(events) - 1) + ["length"]


def test_grpc_stream_sends_a_response_per_committed_block_and_ends_final(server, engine):
    prompt_ids = engine.tokenizer.encode(PROMPTS[0])
    (expected,) = reference(engine, [prompt_ids], **GREEDY)
    results = grpc_stream(server, grpc_inputs(prompt_ids, GREEDY, stream=True, **ALL_COUNTS))
    assert len(results) >= 2
    assert [is_final(result) for result in results] == [False] * (len(results) - 1) + [True]
    assert all(0 < result.as_numpy("output_ids").size <= TEST_SETTINGS["block_size"] * TEST_SETTINGS["buffer_size"]
               for result in results)
    assert np.concatenate([result.as_numpy("output_ids").reshape(-1) for result in results]).tolist() == expected.token_ids
    assert "".join(decoded(result, "text_output") for result in results) == expected.text
    last = results[-1]
    assert decoded(last, "finish_reason") == "length"
    assert last.as_numpy("num_input_tokens").item() == len(prompt_ids)
    assert last.as_numpy("num_output_tokens").item() == GREEDY["max_tokens"]
    assert last.as_numpy("nfe").item() == expected.nfe
    assert results[0].as_numpy("finish_reason") is None


def test_sixteen_concurrent_streams_all_complete_with_the_engine_outputs(server, engine):
    prompts = [f"request {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(16)]
    params = [{"max_tokens": 4 + i % 3 * 4, "temperature": 0} for i in range(16)]  # 1 to 3 blocks
    expected = engine.generate(prompts, [SamplingParams(**p) for p in params])

    def stream(i):
        results = grpc_stream(server, grpc_inputs(prompts[i], params[i], stream=True))
        return np.concatenate([result.as_numpy("output_ids").reshape(-1) for result in results]).tolist()

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(stream, range(16)))
    assert outputs == [output.token_ids for output in expected]


# ---- cancellation -----------------------------------------------------------------------------------------
def assert_pages_return_and_next_request_is_served(server, engine, generated_before: float, max_tokens: int):
    total_pages = engine.metrics().kv_pages_total
    wait_for(lambda: metrics(server)["diffulex_kv_pages_used"] == 0)
    after = metrics(server)
    assert after["diffulex_kv_pages_free"] == total_pages
    assert after["diffulex_num_requests_running"] == after["diffulex_num_requests_waiting"] == 0
    assert after["diffulex_generation_tokens_total"] - generated_before < max_tokens  # it was stopped early
    (expected,) = reference(engine, ["hello"], **GREEDY)
    assert generate(server, {"text_input": "hello", "parameters": GREEDY, "exclude_input_in_output": True}
                    )["text_output"] == expected.text


def test_grpc_cancel_ends_the_request_and_frees_its_pages(server, engine):
    long_params = {"max_tokens": 400, "temperature": 0}
    generated_before = metrics(server)["diffulex_generation_tokens_total"]
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("diffulex", grpc_inputs("once upon a time", long_params, stream=True))
        first, error = responses.get(timeout=120)
        assert error is None and not is_final(first)
        client.stop_stream(cancel_requests=True)
        _, error = responses.get(timeout=30)
    assert isinstance(error, InferenceServerException) and error.status() == "StatusCode.CANCELLED"
    assert_pages_return_and_next_request_is_served(server, engine, generated_before, long_params["max_tokens"])


def test_a_client_that_drops_the_connection_mid_stream_is_cancelled(server, engine):
    generated_before = metrics(server)["diffulex_generation_tokens_total"]
    body = json.dumps({"text_input": "once upon a time", "stream": True, "parameters": {"max_tokens": 400}}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=120) as connection:
        connection.sendall(b"POST /v2/models/diffulex/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:  # the first block has been streamed
            received += connection.recv(4096)
    assert_pages_return_and_next_request_is_served(server, engine, generated_before, 400)


# ---- bad requests -----------------------------------------------------------------------------------------
def too_long_message(engine: Diffulex) -> str:
    with pytest.raises(ValueError) as caught:
        engine.add_request("x" * 600, SamplingParams(max_tokens=16))
    return str(caught.value)


def refusal_message(engine: Diffulex, **param) -> str:
    """The in-process engine's refusal of a request with this one parameter, which names it."""
    (name,) = param
    with pytest.raises(ValueError, match=f"^sampling parameter '{name}' ") as caught:
        engine.add_request("hi", SamplingParams(max_tokens=4, **param))
    return str(caught.value)


@pytest.mark.parametrize("case", ["missing prompt", "invalid JSON", "unknown key", "negative max_tokens",
                                  "over-long prompt", "wrong value type", "a parameter the sampling mode never reads",
                                  "head_select with every page kept"])
def test_bad_request_gets_invalid_arg_naming_the_field_then_a_good_one_is_served(server, engine, case):
    body, message = {
        "missing prompt": ({"stream": False, "parameters": {"max_tokens": 4}},
                           "missing prompt: send 'text_input' (a string) or 'input_ids' (INT64 token ids)"),
        "invalid JSON": ({"text_input": "hi", "sampling_parameters": "{max_tokens: 4"},
                         "input 'sampling_parameters' is not valid JSON: Expecting property name enclosed in "
                         "double quotes: line 1 column 2 (char 1)"),
        "unknown key": ({"text_input": "hi", "parameters": {"max_token": 4}},
                        "request parameters: unknown sampling parameter(s) ['max_token']; allowed: "
                        f"{SamplingParams.field_names()}"),
        "negative max_tokens": ({"text_input": "hi", "parameters": {"max_tokens": -4}},
                                "request parameters: sampling parameter 'max_tokens' must be an integer in [1, 2147483647], "
                                "got -4"),
        "over-long prompt": ({"text_input": "x" * 600, "parameters": {"max_tokens": 16}}, too_long_message(engine)),
        "wrong value type": ({"text_input": "hi", "sampling_parameters": '{"temperature": "warm"}'},
                             "input 'sampling_parameters': sampling parameter 'temperature' must be a finite number "
                             "in [0, 3.402823e+38], got 'warm'"),
        # The served model samples by threshold: `steps` (top-k's schedule) would change nothing.
        "a parameter the sampling mode never reads": (
            {"text_input": "hi", "parameters": {"max_tokens": 4, "steps": 2}}, refusal_message(engine, steps=2)),
        "head_select with every page kept": (
            {"text_input": "hi", "parameters": {"max_tokens": 4, "head_select": False}},
            refusal_message(engine, head_select=False)),
    }[case]
    status, payload = post(f"{server.http_url}/v2/models/diffulex/generate", body)
    assert (status, json.loads(payload)) == (400, {"error": message})
    (expected,) = reference(engine, ["hi"], max_tokens=4)
    assert generate(server, {"text_input": "hi", "parameters": {"max_tokens": 4}, "exclude_input_in_output": True}
                    )["text_output"] == expected.text


def test_wrong_input_dtype_is_rejected_with_its_name_then_a_good_request_is_served(server, engine):
    with pytest.raises(InferenceServerException) as caught:
        grpc_stream(server, [tensor("input_ids", np.array([[1.0, 2.0]], dtype=np.float32))])
    assert "inference input 'input_ids' data-type is 'FP32', but model 'diffulex' expects 'INT64'" in str(caught.value)
    prompt_ids = engine.tokenizer.encode("hi")
    (expected,) = reference(engine, [prompt_ids], max_tokens=4)
    results = grpc_stream(server, grpc_inputs(prompt_ids, {"max_tokens": 4}))
    assert len(results) == 1 and results[0].as_numpy("output_ids").reshape(-1).tolist() == expected.token_ids


# ---- metrics ----------------------------------------------------------------------------------------------
def settled_metrics(server) -> dict:
    """The metrics once the generated-token counter holds still: the model adds a step's tokens to it after it has
    sent that step's responses, so a client can hold its last response a moment before the counter has its tokens."""
    values = metrics(server)
    while (again := metrics(server))["diffulex_generation_tokens_total"] != values["diffulex_generation_tokens_total"]:
        values = again
    return again


def test_metrics_match_what_was_sent(server, engine):
    before = settled_metrics(server)
    outputs = [generate(server, {"text_input": prompt, "parameters": GREEDY, **ALL_COUNTS}) for prompt in PROMPTS]
    generated = sum(output["num_output_tokens"] for output in outputs)
    # Every token sent is counted soon after it is sent: these, and then no more.
    wait_for(lambda: metrics(server)["diffulex_generation_tokens_total"] - before["diffulex_generation_tokens_total"]
             >= generated)
    after = settled_metrics(server)

    def delta(name):
        return after[name] - before[name]

    assert delta("diffulex_prompt_tokens_total") == sum(output["num_input_tokens"] for output in outputs)
    assert delta("diffulex_generation_tokens_total") == generated
    for histogram in ("diffulex_time_to_first_token_seconds", "diffulex_e2e_request_latency_seconds",
                      "diffulex_tokens_per_forward"):
        assert delta(f"{histogram}_count") == len(PROMPTS)
    assert delta("diffulex_tokens_per_forward_sum") == pytest.approx(
        sum(output["num_output_tokens"] / output["nfe"] for output in outputs))
    assert after["diffulex_num_requests_running"] == after["diffulex_num_requests_waiting"] == 0
    assert after["diffulex_kv_pages_used"] == 0
    assert after["diffulex_kv_pages_free"] == engine.metrics().kv_pages_total


def test_prefix_cache_hit_ratio_rises_when_a_prompt_repeats(server):
    prompt = "a prompt long enough to fill several pages of the prefix cache"
    generate(server, {"text_input": prompt, "parameters": {"max_tokens": 4}})
    before = metrics(server)["diffulex_prefix_cache_hit_ratio"]
    generate(server, {"text_input": prompt, "parameters": {"max_tokens": 4}})
    assert 0 < before < metrics(server)["diffulex_prefix_cache_hit_ratio"] <= 1


# ---- loading ----------------------------------------------------------------------------------------------
def test_model_loads_with_the_shipped_settings_and_unloads_after_streaming(server, checkpoint):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model("diffulex_readme")
        assert client.is_model_ready("diffulex_readme")
        parameters = client.get_model_config("diffulex_readme", as_json=True)["config"]["parameters"]
        settings = engine_settings({key: {"string_value": value.get("string_value", "")} for key, value in parameters.items()},
                                   model_dir=checkpoint.parent)
        reference_engine = Diffulex(settings.pop("model"), **settings)
        (expected,) = reference(reference_engine, [PROMPTS[3]], max_tokens=40)
        results = grpc_stream(server, grpc_inputs(PROMPTS[3], {"max_tokens": 40}, stream=True), model="diffulex_readme")
        assert "".join(decoded(result, "text_output") for result in results) == expected.text
        client.unload_model("diffulex_readme")
        wait_for(lambda: model_state(client, "diffulex_readme") == ("UNAVAILABLE", "unloaded"), timeout_s=60)


def test_a_moe_family_picked_by_model_name_streams_the_engine_outputs(server, llada2_checkpoint):
    """LLaDA2 (mixture of experts) through the server: config.pbtxt names the family by an alias of the Diffulex
    flag, and the checkpoint is in the released sharded, one-expert-at-a-time layout."""
    reference_engine = Diffulex(str(llada2_checkpoint), model_name="llada2_mini", **TEST_SETTINGS)
    assert reference_engine.model.arch.num_experts > 1
    (expected,) = reference(reference_engine, [PROMPTS[0]], **GREEDY)
    results = stream_from_a_model_loaded_for_it(server, "diffulex_llada2", PROMPTS[0], GREEDY)
    assert np.concatenate([r.as_numpy("output_ids").reshape(-1) for r in results]).tolist() == expected.token_ids


@pytest.mark.parametrize("name, strategy", [("diffucoder", "d2f"), ("dream_reasoner", "multi_bd"),
                                            ("stable_diffcoder", "multi_bd")])
def test_coder_and_reasoner_families_stream_the_engine_outputs(server, coder_and_reasoner_checkpoints, name, strategy):
    """DiffuCoder and Dream-reasoner named by model_name, Stable-DiffCoder detected from config.json; config.pbtxt
    leaves decoding_strategy empty, so each decodes with its family's default, as the engine in process does."""
    model_name = None if name == "stable_diffcoder" else name
    reference_engine = Diffulex(str(coder_and_reasoner_checkpoints[name]), model_name=model_name, **TEST_SETTINGS)
    assert (reference_engine.config.model_name, reference_engine.config.decoding_strategy) == (name, strategy)
    (expected,) = reference(reference_engine, [PROMPTS[3]], **GREEDY)
    results = stream_from_a_model_loaded_for_it(server, f"diffulex_{name}", PROMPTS[3], GREEDY)
    assert np.concatenate([r.as_numpy("output_ids").reshape(-1) for r in results]).tolist() == expected.token_ids
    assert len(results) >= 2


def test_a_config_key_no_family_lists_loads_and_the_server_log_names_it(server, engine, unknown_key_checkpoint):
    (expected,) = reference(engine, [PROMPTS[0]], **GREEDY)  # the same weights, without the key
    results = stream_from_a_model_loaded_for_it(server, "diffulex_unknown_key", PROMPTS[0], GREEDY)
    assert np.concatenate([r.as_numpy("output_ids").reshape(-1) for r in results]).tolist() == expected.token_ids
    assert (f"{unknown_key_checkpoint / 'config.json'}: config keys ['newly_added_key'] are unknown to model 'llada'"
            in server.log_tail(200_000))


def test_fast_dllm_v2_streams_a_response_per_block_with_per_request_overrides(server, fast_dllm_v2_checkpoint):
    """Block-causal blocks decoded sub-block by sub-block; a request's sub_block_size and accept_threshold change
    what it decodes (the two parameter sets give different tokens and forward counts in process)."""
    reference_engine = Diffulex(str(fast_dllm_v2_checkpoint), **FAST_DLLM_V2_SETTINGS)
    seen = []
    for params in ({"max_tokens": 16, "temperature": 0, "ignore_eos": True},
                   {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "sub_block_size": 2, "accept_threshold": 0.6}):
        (expected,) = reference(reference_engine, [PROMPTS[1]], **params)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.load_model("diffulex_fast_dllm_v2")
            results = grpc_stream(server, grpc_inputs(PROMPTS[1], params, stream=True), model="diffulex_fast_dllm_v2")
        outputs = [result.as_numpy("output_ids").reshape(-1).tolist() for result in results]
        assert sum(outputs, []) == expected.token_ids
        assert len(results) >= 2 and all(len(ids) <= FAST_DLLM_V2_SETTINGS["block_size"] for ids in outputs)
        seen.append((expected.token_ids, expected.nfe))
    assert seen[0] != seen[1]
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.unload_model("diffulex_fast_dllm_v2")
        wait_for(lambda: model_state(client, "diffulex_fast_dllm_v2") == ("UNAVAILABLE", "unloaded"), timeout_s=60)


def test_a_request_picks_its_lora_adapter_by_name_and_an_unknown_one_is_refused(server, checkpoint,
                                                                               served_lora_modules):
    reference_engine = Diffulex(str(checkpoint), lora_modules=served_lora_modules, **TEST_SETTINGS)
    (with_adapter,) = reference(reference_engine, [PROMPTS[2]], **GREEDY, lora_name="math")
    (without,) = reference(reference_engine, [PROMPTS[2]], **GREEDY)
    assert with_adapter.token_ids != without.token_ids
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model("diffulex_lora")
        for lora_name, expected in (("math", with_adapter), (None, without)):
            params = {**GREEDY, **({"lora_name": lora_name} if lora_name else {})}
            output = generate(server, {"text_input": PROMPTS[2], "exclude_input_in_output": True,
                                       "sampling_parameters": json.dumps(params)}, model="diffulex_lora")
            assert ids(output["output_ids"]) == expected.token_ids
        status, payload = post(f"{server.http_url}/v2/models/diffulex_lora/generate",
                               {"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "poetry"})})
        assert status == 400 and "'poetry'" in json.loads(payload)["error"] and "math" in json.loads(payload)["error"]
        client.unload_model("diffulex_lora")
        wait_for(lambda: model_state(client, "diffulex_lora") == ("UNAVAILABLE", "unloaded"), timeout_s=60)


def test_a_request_whose_adapter_overflows_ends_with_an_error_and_the_model_serves_on(server, checkpoint,
                                                                                     served_lora_modules):
    reference_engine = Diffulex(str(checkpoint), lora_modules=served_lora_modules, **TEST_SETTINGS)
    expected = {name: reference(reference_engine, [PROMPTS[2]], **GREEDY, lora_name=name)[0] for name in ("math", None)}
    url = f"{server.http_url}/v2/models/diffulex_lora/generate"

    def body(lora_name):
        params = {**GREEDY, **({"lora_name": lora_name} if lora_name else {})}
        return {"text_input": PROMPTS[2], "exclude_input_in_output": True, "sampling_parameters": json.dumps(params)}

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model("diffulex_lora")
        with ThreadPoolExecutor(2) as pool:  # the failing request beside one that decodes
            failing, served = pool.submit(post, url, body("huge")), pool.submit(post, url, body("math"))
            (status, payload), (served_status, served_payload) = failing.result(), served.result()
        # Triton 2.51's generate endpoint answers a model's error with 400, whatever its kind (INTERNAL here).
        assert (status, json.loads(payload)["error"]) == (400, NON_FINITE_ERROR)
        assert served_status == 200 and ids(json.loads(served_payload)["output_ids"]) == expected["math"].token_ids
        with pytest.raises(InferenceServerException) as caught:
            grpc_stream(server, grpc_inputs(PROMPTS[2], {**GREEDY, "lora_name": "huge"}, stream=True),
                        model="diffulex_lora")
        assert caught.value.message() == NON_FINITE_ERROR
        for lora_name, want in expected.items():
            assert ids(generate(server, body(lora_name), model="diffulex_lora")["output_ids"]) == want.token_ids
        wait_for(lambda: metrics(server, "diffulex_lora")["diffulex_kv_pages_used"] == 0)
        client.unload_model("diffulex_lora")
        wait_for(lambda: model_state(client, "diffulex_lora") == ("UNAVAILABLE", "unloaded"), timeout_s=60)


def test_dmax_streams_a_response_per_block_with_a_per_request_edit_threshold(server, checkpoint):
    reference_engine = Diffulex(str(checkpoint), decoding_strategy="dmax", **TEST_SETTINGS)
    seen = []
    for params in ({"max_tokens": 16, "temperature": 0, "ignore_eos": True},
                   {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "edit_threshold": 0.0}):
        (expected,) = reference(reference_engine, [PROMPTS[3]], **params)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.load_model("diffulex_dmax")
            results = grpc_stream(server, grpc_inputs(PROMPTS[3], params, stream=True, return_nfe=True),
                                  model="diffulex_dmax")
        outputs = [result.as_numpy("output_ids").reshape(-1).tolist() for result in results]
        assert sum(outputs, []) == expected.token_ids and len(results) >= 2
        assert results[-1].as_numpy("nfe").item() == expected.nfe
        seen.append((expected.token_ids, expected.nfe))
    assert seen[0] != seen[1]  # the request's edit_threshold reached the decoding
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.unload_model("diffulex_dmax")
        wait_for(lambda: model_state(client, "diffulex_dmax") == ("UNAVAILABLE", "unloaded"), timeout_s=60)


def stream_from_a_model_loaded_for_it(server, name: str, prompt: str, params: dict) -> list:
    """Loads model `name`, streams one request from it, and unloads it again; returns the stream's results."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model(name)
        results = grpc_stream(server, grpc_inputs(prompt, params, stream=True), model=name)
        client.unload_model(name)
        wait_for(lambda: model_state(client, name) == ("UNAVAILABLE", "unloaded"), timeout_s=60)
    return results


def model_state(client, name: str) -> tuple[str, str]:
    (entry,) = [model for model in client.get_model_repository_index(as_json=True)["models"] if model["name"] == name]
    return entry.get("state", ""), entry.get("reason", "")


def test_model_fails_to_load_with_its_message_on_a_bad_model_path(server, missing_checkpoint):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("diffulex_bad_path")
        assert f"{missing_checkpoint}: checkpoint directory not found" in caught.value.message()
        assert not client.is_model_ready("diffulex_bad_path")
        assert client.is_model_ready("diffulex")


def test_weights_no_model_could_load_fail_the_load_by_name_and_the_loaded_model_keeps_serving(server, engine,
                                                                                              corrupt_models):
    (expected,) = reference(engine, [PROMPTS[0]], **GREEDY)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for name, (_, words) in corrupt_models.items():
            with pytest.raises(InferenceServerException) as caught:
                client.load_model(name)
            assert words in caught.value.message(), name
            assert not client.is_model_ready(name)
            output = generate(server, {"text_input": PROMPTS[0], "parameters": GREEDY,
                                       "exclude_input_in_output": True})
            assert ids(output["output_ids"]) == expected.token_ids


@pytest.mark.parametrize("name", sorted(BAD_SETTINGS))
def test_a_bad_setting_fails_the_load_by_its_name_and_the_loaded_model_keeps_serving(server, engine, name):
    _, message = BAD_SETTINGS[name]
    (expected,) = reference(engine, [PROMPTS[0]], **GREEDY)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model(f"diffulex_bad_{name}")
        assert message in caught.value.message()
        assert not client.is_model_ready(f"diffulex_bad_{name}")
    output = generate(server, {"text_input": PROMPTS[0], "parameters": GREEDY, "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids


def test_the_python_backends_own_parameters_are_taken_beside_the_engines_or_refused_by_name(server, engine):
    """FORCE_CPU_ONLY_INPUT_TENSORS shares config.pbtxt's parameters with the engine's settings: "yes" (the
    backend's default, the model's inputs on the host) loads and serves; "no" fails the load with the model's
    reason, and the model already loaded keeps serving."""
    (expected,) = reference(engine, [PROMPTS[0]], **GREEDY)
    results = stream_from_a_model_loaded_for_it(server, "diffulex_host_inputs", PROMPTS[0], GREEDY)
    assert np.concatenate([r.as_numpy("output_ids").reshape(-1) for r in results]).tolist() == expected.token_ids
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("diffulex_device_inputs")
        assert ("parameter 'FORCE_CPU_ONLY_INPUT_TENSORS' in config.pbtxt must be 'yes', got 'no': the model reads "
                "its inputs (text, token ids, settings) on the host") in caught.value.message()
        assert not client.is_model_ready("diffulex_device_inputs")
    output = generate(server, {"text_input": PROMPTS[0], "parameters": GREEDY, "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids


def test_an_engine_failure_ends_open_requests_and_the_model_comes_back_until_it_fails_at_start_too_often(
        server, engine):
    """No request causes an engine failure (each is checked before it joins a step), so the model is reloaded: a new
    stub and engine. The failing test engine fails again at its first step, which shows the reload; after
    MAX_RELOADS_AT_START reloads that each failed before their first step, the watchdog leaves it unloaded."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model("diffulex_failing")
        (first_stub,) = stub_pids(server, "diffulex_failing")
        with pytest.raises(InferenceServerException) as caught:
            grpc_stream(server, grpc_inputs("hello", GREEDY, stream=True), model="diffulex_failing")
        assert caught.value.message() == ("the engine failed and this model can no longer serve: "
                                          "RuntimeError: device lost")
        wait_for(lambda: stub_pids(server, "diffulex_failing") not in ([], [first_stub])
                 and client.is_model_ready("diffulex_failing"), timeout_s=120)
        # Failures and reloads racing 16 concurrent requests: each ends with an error, and the server lives on.
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: post(f"{server.http_url}/v2/models/diffulex_failing/generate",
                                                   {"text_input": f"race {i}", "parameters": GREEDY}), range(16)))
        assert all(status in (400, 404, 503) and json.loads(payload)["error"] for status, payload in answers), answers
        assert server.process.poll() is None
        given_up = ("model 'diffulex_failing' failed before its first step after each of its last "
                    f"{MAX_RELOADS_AT_START} reloads")

        def failed_again_or_given_up() -> bool:
            if given_up in server.log_tail(200000):
                return True
            if client.is_model_ready("diffulex_failing"):
                post(f"{server.http_url}/v2/models/diffulex_failing/generate",
                     {"text_input": "again", "parameters": GREEDY})
            return False

        wait_for(failed_again_or_given_up, timeout_s=300)
        wait_for(lambda: not client.is_model_ready("diffulex_failing"), timeout_s=10)
        time.sleep(3)
        assert not client.is_model_ready("diffulex_failing")  # and it stays unloaded
    (expected,) = reference(engine, ["hello"], **GREEDY)
    assert generate(server, {"text_input": "hello", "parameters": GREEDY, "exclude_input_in_output": True}
                    )["text_output"] == expected.text


def test_the_load_log_gives_load_and_warm_up_times_and_the_kernel_cache(server):
    """The model turns ready only once warmed up, and says how long loading and warming took."""
    log = server.log_path.read_text(errors="replace")
    # One batch size on a CPU; on a GPU every size the scheduler can form, up to max_num_reqs.
    found = re.search(r"diffulex: engine ready in ([\d.]+) s \(load ([\d.]+) s, warm-up ([\d.]+) s over batch sizes "
                      r"\[1(?:, \d+)*\]; kernel cache (\S+)\)", log)
    assert found, log[-3000:]
    total, load, warm = map(float, found.groups()[:3])
    assert 0 <= load <= total and 0 <= warm <= total
    assert found.group(4).endswith("triton")
