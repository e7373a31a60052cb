"""prepare_request refuses, alone and before any step, what a step could not serve, and normalises what it can."""
from __future__ import annotations

import time

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID, MASK_TOKEN, MASK_TOKEN_ID
from engine_driver import run_requests, tiny_engine


@pytest.fixture(scope="module")
def llm(llada_checkpoint):
    return tiny_engine(llada_checkpoint, max_model_len=64)


def refused(llm, message, prompt, params=None):
    with pytest.raises(ValueError) as caught:
        llm.prepare_request(prompt, params)
    assert str(caught.value) == message
    assert not llm.has_unfinished_requests()


def test_the_mask_token_in_a_prompt_is_refused(llm):
    refused(llm, f"prompt holds the mask token ({MASK_TOKEN_ID}) at position 1; the engine decodes masked positions "
                 "only in the generation area", [5, MASK_TOKEN_ID, 6])
    refused(llm, f"prompt holds the mask token ({MASK_TOKEN_ID}) at position 2; the engine decodes masked positions "
                 "only in the generation area", "hi" + MASK_TOKEN)


def test_a_stop_token_outside_the_vocabulary_is_refused(llm):
    refused(llm, "sampling parameter 'stop_token_ids' holds 258, outside the vocabulary [0, 258)", "hi",
            SamplingParams(stop_token_ids=[3, 258]))


def test_a_text_too_long_to_ever_fit_is_refused_before_it_is_tokenized(llm):
    limit = 64 * llm.max_token_chars
    started = time.perf_counter()
    refused(llm, f"prompt has 4000000 characters; at most {limit} can fit max_model_len (64) tokens", "x" * 4_000_000)
    assert time.perf_counter() - started < 0.5  # tokenizing 4M characters takes seconds


def test_seeds_past_32_bits_fold_into_the_noise_key_and_top_k_past_the_vocabulary_keeps_it_all(llm):
    assert llm.prepare_request("hi", SamplingParams(max_tokens=8, seed=7)).sampling.seed == 7
    assert llm.prepare_request("hi", SamplingParams(max_tokens=8, seed=2**64 - 1)).sampling.seed == 0
    assert llm.prepare_request("hi", SamplingParams(max_tokens=8, seed=(5 << 32) | 3)).sampling.seed == 6
    assert llm.prepare_request("hi", SamplingParams(max_tokens=8, top_k=2**31 - 1)).params.top_k == 258


def test_extreme_values_decode_like_their_meaning(llm):
    """Each would overflow an int64 or a float32 in the step if it reached it unchanged."""
    greedy = run_requests(llm, ["12+34="], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    for params in (SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-30, seed=2**64 - 1),
                   SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-30, top_k=2**31 - 1)):
        assert run_requests(llm, ["12+34="], params)[0].token_ids == greedy
    hot = SamplingParams(max_tokens=8, ignore_eos=True, temperature=3.4e38, top_k=2**31 - 1, seed=2**63)
    assert len(run_requests(llm, ["12+34="], hot)[0].token_ids) == 8
    assert llm.metrics().kv_pages_used == 0


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    """Stop tokens cannot be sampled among the first min_tokens outputs; later ones end the request."""
    free = run_requests(llm, ["hi"], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    stop_at = free[1]
    early = run_requests(llm, ["hi"], SamplingParams(max_tokens=24, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert early.token_ids == free[: free.index(stop_at)]
    held = run_requests(llm, ["hi"], SamplingParams(max_tokens=24, min_tokens=12, stop_token_ids=[stop_at],
                                                    ignore_eos=True))[0]
    assert len(held.token_ids) >= 12
    assert stop_at not in held.token_ids
    assert EOS_TOKEN_ID != MASK_TOKEN_ID
