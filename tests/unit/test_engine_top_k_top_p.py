"""A request's top_k and top_p decide what it can sample: at a temperature that makes the tiny random model's
distribution nearly flat, keeping only the top token gives the greedy output whatever the seed, and keeping the
whole vocabulary does not."""
from __future__ import annotations

import pytest

from diffulex_backend import Diffulex, SamplingParams
from engine_driver import TINY_LIMITS

PROMPTS = ["hello world", "the quick brown fox"]
SEEDS = range(4)
HOT = 50.0  # far above the tiny model's logit spread: every token of the vocabulary is likely


@pytest.fixture(scope="module")
def llm(llada_checkpoint) -> Diffulex:
    return Diffulex(llada_checkpoint, **TINY_LIMITS)


def generate(llm: Diffulex, **params) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, **params))
    return [output.token_ids for output in outputs]


@pytest.fixture(scope="module")
def greedy(llm) -> list[list[int]]:
    return generate(llm, temperature=0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_top_k_1_samples_the_greedy_tokens_whatever_the_seed(llm, greedy, seed):
    assert generate(llm, temperature=HOT, top_k=1, seed=seed) == greedy


@pytest.mark.parametrize("seed", SEEDS)
def test_a_tiny_top_p_samples_the_greedy_tokens_whatever_the_seed(llm, greedy, seed):
    assert generate(llm, temperature=HOT, top_p=1e-3, seed=seed) == greedy


def test_without_top_k_or_top_p_the_same_seeds_sample_other_tokens(llm, greedy):
    sampled = [generate(llm, temperature=HOT, top_k=0, top_p=1.0, seed=seed) for seed in SEEDS]
    assert all(tokens != greedy for tokens in sampled)
    assert len({str(tokens) for tokens in sampled}) == len(SEEDS)  # and the seeds draw differently
