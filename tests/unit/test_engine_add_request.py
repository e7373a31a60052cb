"""add_request refuses what it could never serve, with a message that says why, and changes nothing when it does."""
from __future__ import annotations

import re

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.sampling import FLOAT32_MAX, INT32_MAX, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, UINT64_MAX
from engine_driver import run_requests, tiny_engine


@pytest.fixture(scope="module")
def llm(llada_checkpoint):
    return tiny_engine(llada_checkpoint, max_model_len=64)


def refused(llm, message, *args, **kwargs):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        llm.add_request(*args, **kwargs)
    assert not llm.has_unfinished_requests()
    assert llm.metrics().num_waiting == 0


def test_prompt_plus_max_tokens_over_max_model_len_is_rejected_not_truncated(llm):
    refused(llm, "prompt has 5 tokens and max_tokens is 60: 5 + 60 = 65 exceeds max_model_len (64)",
            "hello", SamplingParams(max_tokens=60))
    refused(llm, "prompt has 70 tokens and max_tokens is 1: 70 + 1 = 71 exceeds max_model_len (64)",
            [65] * 70, SamplingParams(max_tokens=1))


def test_a_request_at_exactly_max_model_len_is_served(llm):
    stream = run_requests(llm, ["hello"], SamplingParams(max_tokens=59, ignore_eos=True))[0]
    assert len(stream.token_ids) == 59


def test_empty_prompt_is_rejected(llm):
    refused(llm, "prompt is empty", "")
    refused(llm, "prompt is empty", [])


def test_token_ids_outside_the_vocabulary_are_rejected(llm):
    refused(llm, "prompt token id 258 is out of range [0, 258)", [1, 258, 2])
    refused(llm, "prompt token id -1 is out of range [0, 258)", [-1])


def test_params_must_be_sampling_params(llm):
    refused(llm, "params must be SamplingParams, got dict", "hello", {"max_tokens": 4})


def test_a_request_id_in_use_is_rejected(llm):
    rid = llm.add_request("hello", SamplingParams(max_tokens=4), request_id="mine")
    try:
        with pytest.raises(ValueError, match="^request id 'mine' is already in use$"):
            llm.add_request("other", SamplingParams(max_tokens=4), request_id="mine")
    finally:
        llm.abort(rid)
    assert llm.metrics().kv_pages_used == 0


def test_a_request_larger_than_the_whole_kv_pool_is_rejected(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, num_kv_pages=4)
    refused(llm, "request needs up to 5 KV pages but the cache has 4", "hello", SamplingParams(max_tokens=12))


def test_d2f_rejects_a_prompt_it_cannot_prefill_in_one_forward(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, decoding_strategy="d2f", max_num_batched_tokens=16)
    refused(llm, "prompt has 20 tokens; decoding_strategy 'd2f' prefills a prompt in one forward, so it must fit "
                 "max_num_batched_tokens (16)", "x" * 20, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 0, f"an integer in [1, {INT32_MAX}]"),
    ("temperature", -0.5, f"a finite number in [0, {FLOAT32_MAX:.7g}]"),
    ("top_k", -1, f"an integer in [0, {INT32_MAX}] (0 disables it)"),
    ("top_p", 0.0, "a number in (0, 1]"),
    ("seed", -3, f"an integer in [0, {UINT64_MAX}] or null"),
    ("stop", [""], f"a list of at most {MAX_STOP_STRINGS} non-empty strings"),
    ("stop_token_ids", [-1], f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {INT32_MAX}]"),
    ("ignore_eos", 1, "true or false"),
    ("confidence", "entropy", "one of ['margin', 'neg_entropy', 'prob']"),
    ("steps", 0, f"an integer in [1, {INT32_MAX}] or null"),
    ("accept_threshold", 1.5, "a number in [0, 1] or null"),
    ("remask_threshold", -0.1, "a number in [0, 1] or null"),
])
def test_invalid_sampling_parameter_names_the_parameter(field, value, allowed):
    with pytest.raises(ValueError, match="^" + re.escape(f"sampling parameter '{field}' must be {allowed}, got {value!r}") + "$"):
        SamplingParams(**{field: value})


def test_unknown_sampling_parameter_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"^unknown sampling parameter\(s\) \['max_new_tokens'\]; allowed: \["):
        SamplingParams.from_dict({"max_new_tokens": 4})
