"""Log-probabilities, min_tokens and the prefix-cache counters through a real tritonserver: the generate endpoint and
a tritonclient gRPC stream get the engine's numbers, in TensorRT-LLM's output names as well as `log_probs`."""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from served import generate, generate_stream, grpc_inputs, grpc_stream, ids, metrics, post, wait_for

from diffulex_backend import SamplingParams

PROMPT = "the quick brown fox"
# The server's engine and the reference run float32 in two processes, whose reductions may round differently.
CLOSE = {"rel": 1e-5, "abs": 1e-5}
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def flat(value) -> list:
    return np.asarray(value, dtype=np.float64).reshape(-1).tolist()


@pytest.fixture(scope="module")
def expected(engine):
    (out,) = engine.generate([PROMPT], SamplingParams(**GREEDY, logprobs=2))
    return out


def test_generate_returns_the_engines_logprobs_under_both_names(server, expected):
    output = generate(server, {"text_input": PROMPT, "sampling_parameters": json.dumps(GREEDY),
                               "return_log_probs": True, "exclude_input_in_output": True})
    assert ids(output["output_ids"]) == expected.token_ids
    assert flat(output["log_probs"]) == pytest.approx(expected.logprobs, **CLOSE)
    assert flat(output["output_log_probs"]) == pytest.approx(expected.logprobs, **CLOSE)
    assert flat(output["cum_log_probs"]) == pytest.approx([sum(expected.logprobs)], abs=1e-4)
    assert "top_log_probs" not in output  # logprobs 0: the tokens' own only


def test_a_grpc_stream_carries_each_blocks_logprobs_and_the_top_tokens(server, expected):
    results = grpc_stream(server, grpc_inputs(PROMPT, {**GREEDY, "logprobs": 2}, stream=True))
    tokens = sum((r.as_numpy("output_ids").reshape(-1).tolist() for r in results), [])
    logprobs = sum((r.as_numpy("log_probs").reshape(-1).tolist() for r in results), [])
    top_ids = np.concatenate([r.as_numpy("top_log_prob_ids")[0] for r in results])
    top_lps = np.concatenate([r.as_numpy("top_log_probs")[0] for r in results])
    assert tokens == expected.token_ids
    assert logprobs == pytest.approx(expected.logprobs, **CLOSE)
    assert top_ids.tolist() == [list(t) for t in expected.top_logprobs]
    assert top_lps.reshape(-1).tolist() == pytest.approx([v for t in expected.top_logprobs for v in t.values()],
                                                         **CLOSE)
    assert flat(results[-1].as_numpy("cum_log_probs")) == pytest.approx([sum(expected.logprobs)], abs=1e-4)


def test_a_request_that_does_not_ask_gets_no_logprobs(server):
    events = generate_stream(server, {"text_input": PROMPT, "parameters": {"max_tokens": 8}, "stream": True})
    assert events and not any({"log_probs", "output_log_probs", "cum_log_probs"} & set(event) for event in events)


def test_min_tokens_gives_at_least_that_many_tokens(server, engine):
    """genai-perf's fixed output length: min_tokens = max_tokens without ignore_eos."""
    params = {"max_tokens": 16, "min_tokens": 16, "temperature": 1.0, "seed": 5}
    (want,) = engine.generate([PROMPT], SamplingParams(**params))
    output = generate(server, {"text_input": PROMPT, "sampling_parameters": json.dumps(params),
                               "return_num_output_tokens": True, "exclude_input_in_output": True})
    assert output["num_output_tokens"] == 16 and ids(output["output_ids"]) == want.token_ids
    assert not set(engine.eos_token_ids) & set(want.token_ids)


def test_the_prefix_cache_counters_count_hit_and_queried_tokens(server, engine):
    prompt = "#counters# long enough to fill several pages of four tokens, sent twice"  # shares no page with others
    names = ("diffulex_prefix_cache_hit_tokens_total", "diffulex_prefix_cache_queried_tokens_total")
    before = [metrics(server).get(name, 0) for name in names]
    generate(server, {"text_input": prompt, "parameters": {"max_tokens": 4}})
    generate(server, {"text_input": prompt, "parameters": {"max_tokens": 4}})
    page_tokens = (len(engine.tokenizer.encode(prompt)) - 1) // 4 * 4  # the last prompt token is always recomputed
    wait_for(lambda: metrics(server)[names[1]] - before[1] == 2 * page_tokens)
    assert metrics(server)[names[0]] - before[0] == page_tokens


def _refuse_constant(name: str):
    raise ValueError(f"{name} in the response")


def test_alternatives_that_could_not_be_sampled_come_as_the_floor_in_valid_json(server, engine, expected):
    """With one or two tokens left to sample (min_tokens bans the other stop ids) and five alternatives asked for, the
    rest have a log-probability of minus infinity: the generate endpoint writes them as -9999.0, as OpenAI and vLLM
    do, and the response is strict JSON, with no infinity in it; the tokens that could be sampled carry the engine's
    numbers. Sent at once beside four good requests, which get the engine's tokens and log-probabilities."""
    vocab, mask = engine.model.arch.vocab_size, engine.config.mask_token_id
    url = f"{server.http_url}/v2/models/diffulex/generate"
    cases = []
    for keep in ([5], [5, 6]):
        params = {"max_tokens": 4, "min_tokens": 4, "ignore_eos": True, "temperature": 0, "logprobs": 5,
                  "stop_token_ids": [t for t in range(vocab) if t not in keep and t != mask]}
        cases.append((keep, params, engine.generate([PROMPT], SamplingParams(**params))[0]))
    bodies = [{"text_input": PROMPT, "sampling_parameters": json.dumps(params), "exclude_input_in_output": True}
              for _, params, _ in cases]
    bodies += [{"text_input": PROMPT, "sampling_parameters": json.dumps({**GREEDY, "logprobs": 2}),
                "exclude_input_in_output": True}] * 4
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda body: post(url, body), bodies))
    for (status, payload), (keep, _, want) in zip(results, cases):
        assert status == 200, payload
        output = json.loads(payload, parse_constant=_refuse_constant)
        assert ids(output["output_ids"]) == want.token_ids
        top_ids = np.asarray(output["top_log_prob_ids"]).reshape(4, 5)
        top_lps = np.asarray(output["top_log_probs"], dtype=np.float64).reshape(4, 5)
        left = len(keep)
        for position, alternatives in enumerate(want.top_logprobs):
            assert sorted(top_ids[position, :left].tolist()) == keep
            assert top_lps[position, :left].tolist() == pytest.approx(list(alternatives.values())[:left], **CLOSE)
            assert top_lps[position, left:].tolist() == [-9999.0] * (5 - left)
            assert all(value == float("-inf") for value in list(alternatives.values())[left:])  # the engine's own
    for status, payload in results[len(cases):]:
        assert status == 200, payload
        output = json.loads(payload, parse_constant=_refuse_constant)
        assert ids(output["output_ids"]) == expected.token_ids
        assert flat(output["log_probs"]) == pytest.approx(expected.logprobs, **CLOSE)
