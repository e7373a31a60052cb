"""Fuzzing the front with hypothesis, through the real front and tritonserver, on 127.0.0.1 only: bodies built from
every OpenAI field and model setting with values at their types' edges, wrong types, nesting and junk. Every request
ends, within its timeout, with a 200 or a 4xx in OpenAI's error shape that names a field of the body, never a 500; a
good completion sent beside each bad one gets exactly the text it gets alone, and a good chat after each bad chat
gets its sum."""

import json
import math
from concurrent.futures import ThreadPoolExecutor

from front_requests import API_KEY, DEMO_MODEL, error_in, post
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffulex_backend import SamplingParams
from diffulex_client.openai_front.schemas import ChatCompletionRequest, CompletionRequest

INT_EDGES = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**64 - 1, 2**64, -(2**63), 10**30]
FLOAT_EDGES = [0.0, -0.0, 1e-45, 0.5, 1.0, 2.0, 3.5e38, 1e308, -1.0, math.inf, -math.inf, math.nan]
scalars = st.one_of(st.sampled_from(INT_EDGES), st.integers(), st.sampled_from(FLOAT_EDGES), st.floats(),
                    st.booleans(), st.none(), st.text(max_size=12),
                    st.sampled_from(["16", "text", "", "\x00", "\ud7ff"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                            max_size=3), max_leaves=8)
FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                | set(SamplingParams.field_names()) | {"top_a", ""})
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)
prompts = st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 255), min_size=1, max_size=8))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                           "content": st.one_of(st.text(max_size=20), values)}),
                    min_size=0, max_size=3)
GOOD = {"model": "diffulex", "prompt": "hello", "max_tokens": 8, "temperature": 0}
EXAMPLES = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def assert_answered(response, body: dict) -> None:
    """A 200, or a 4xx in OpenAI's shape whose `param` names a field of the body the client sent."""
    assert response.status_code in (200, 400, 404, 413), (response.status_code, response.text)
    if response.status_code != 200:
        error = error_in(response.text)
        if response.status_code == 400:
            field = (error["param"] or "").split(".")[0].split("[")[0]
            assert field in body, (error, sorted(body))
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event[len("data: "):]), event


def good_text(front) -> str:
    return post(front, "/v1/completions", GOOD, API_KEY, timeout=60).json()["choices"][0]["text"]


@EXAMPLES
@given(body=bodies, prompt=prompts)
def test_fuzzed_completions_are_answered_and_a_good_request_beside_them_is_unaffected(front, body, prompt):
    expected = good_text(front)  # alone
    fuzzed = {"model": "diffulex", "prompt": prompt, "max_tokens": 4, **body}
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(post, front, "/v1/completions", fuzzed, API_KEY, 60)
        good = pool.submit(good_text, front)
        assert_answered(bad.result(), fuzzed)
        assert good.result() == expected


@EXAMPLES
@given(body=bodies, conversation=messages)
def test_fuzzed_chat_requests_are_answered(demo_front, body, conversation):
    fuzzed = {"model": DEMO_MODEL, "messages": conversation, "max_tokens": 4, **body}
    assert_answered(post(demo_front, "/v1/chat/completions", fuzzed, timeout=60), fuzzed)
    answer = post(demo_front, "/v1/chat/completions",
                  {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "12+34="}]}, timeout=60)
    assert answer.json()["choices"][0]["message"]["content"] == "46"
