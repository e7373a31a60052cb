"""Continuous batching: a request's output does not depend on what else runs beside it, on preemption, or on how
its prompt was split into chunks; and every step stays inside the token and request budgets."""
from __future__ import annotations

import pytest

from diffulex_backend import SamplingParams
from engine_driver import Stream, run_one_at_a_time, run_requests, step_checked, tiny_engine

PROMPTS = ["hello world", "the quick brown fox", "ab", "diffusion language models decode blocks"]

STRATEGIES = [
    pytest.param(dict(decoding_strategy="multi_bd", buffer_size=1), id="multi_bd-buffer1"),
    pytest.param(dict(decoding_strategy="multi_bd", buffer_size=3), id="multi_bd-buffer3"),
    pytest.param(dict(decoding_strategy="d2f", buffer_size=2), id="d2f-buffer2"),
]

# Greedy, and sampled with a seed per request (request i gets seed i). accept 0.7 leaves several steps per
# block, so the requests really are interleaved.
SAMPLING = [
    pytest.param([SamplingParams(max_tokens=16, ignore_eos=True)] * len(PROMPTS), id="greedy"),
    pytest.param([SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=i) for i in range(len(PROMPTS))],
                 id="seeded"),
]

# 4 requests of up to 39 + 16 tokens need up to 14 pages of 4 each; 16 pages cannot hold them all.
SMALL_POOL = 16


def tokens(streams: list[Stream]) -> list[list[int]]:
    return [s.token_ids for s in streams]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("params", SAMPLING)
def test_same_outputs_one_at_a_time_batched_and_preempted(llada_checkpoint, strategy, params):
    # A roomy token budget: every prompt fits one forward, whatever shares it.
    limits = dict(accept_threshold=0.7, max_num_batched_tokens=256, **strategy)
    alone = run_one_at_a_time(tiny_engine(llada_checkpoint, **limits), PROMPTS, params)
    batched = run_requests(tiny_engine(llada_checkpoint, **limits), PROMPTS, params)
    small = tiny_engine(llada_checkpoint, num_kv_pages=SMALL_POOL, **limits)
    preempted = run_requests(small, PROMPTS, params)

    assert tokens(batched) == tokens(alone)
    assert small.metrics().num_preemptions > 0
    assert tokens(preempted) == tokens(alone)
    assert all(len(s.token_ids) == 16 for s in alone)
    assert small.metrics().kv_pages_used == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("params", SAMPLING)
def test_same_outputs_when_a_tight_token_budget_splits_prefills_differently(llada_checkpoint, strategy, params):
    # 48 tokens per forward: batched, the long prompt waits or is prefilled in other chunks than alone. A seed
    # must still give the same tokens: sampling noise may depend on the request's own decoding progress only.
    limits = dict(accept_threshold=0.7, max_num_batched_tokens=48, **strategy)
    alone = run_one_at_a_time(tiny_engine(llada_checkpoint, **limits), PROMPTS, params)
    batched = run_requests(tiny_engine(llada_checkpoint, **limits), PROMPTS, params)
    assert tokens(batched) == tokens(alone)


def test_seeded_sampling_differs_between_seeds_and_repeats_with_the_same_seed(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, accept_threshold=0.7)
    sampled = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=s) for s in (1, 2, 1)]
    a, b, a_again = run_requests(llm, ["hello world"] * 3, sampled)
    assert a.token_ids == a_again.token_ids
    assert a.token_ids != b.token_ids


def test_each_step_stays_within_the_token_and_request_budgets(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, buffer_size=2, max_num_batched_tokens=16, max_num_reqs=2,
                      accept_threshold=0.7)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    streams = run_requests(llm, ["a long prompt that needs several forwards", "hi", "third", "fourth one"], params)
    assert [len(s.token_ids) for s in streams] == [12] * 4
    assert llm.metrics().kv_pages_used == 0


def test_long_prompt_is_prefilled_in_chunks_beside_other_requests_decoding(llada_checkpoint):
    budget = 16
    llm = tiny_engine(llada_checkpoint, buffer_size=2, max_num_batched_tokens=budget, accept_threshold=0.7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    long_prompt = "x" * 50
    short = llm.add_request("short", params)
    step_checked(llm)
    long = llm.add_request(long_prompt, params)

    chunks, mixed = [], 0
    streams = {short: Stream(short), long: Stream(long)}
    while llm.has_unfinished_requests():
        for delta in step_checked(llm):
            streams[delta.request_id].deltas.append(delta)
        plans = {p.request_id: p for p in llm.last_schedule.plans}
        if long in plans and plans[long].end <= 50:  # the long prompt's prefill, no block predicted yet
            chunks.append((plans[long].start, plans[long].end))
            mixed += short in plans and bool(plans[short].blocks)
        assert len(chunks) < 50, "the long prompt never finished its prefill"

    assert len(chunks) >= 50 // budget
    assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]], "chunks must be contiguous"
    assert chunks[0][0] == 0
    assert mixed >= 1, "no forward held both a prefill chunk and another request's decoding blocks"

    # Chunking is exact: the same outputs as with a budget that prefills each prompt at once.
    roomy = tiny_engine(llada_checkpoint, buffer_size=2, accept_threshold=0.7)
    want = run_one_at_a_time(roomy, ["short", long_prompt], params)
    assert [streams[short].token_ids, streams[long].token_ids] == tokens(want)


def test_no_more_requests_run_than_max_num_reqs(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, max_num_reqs=2, accept_threshold=0.7)
    for prompt in PROMPTS:
        llm.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    step_checked(llm)
    metrics = llm.metrics()
    assert (metrics.num_running, metrics.num_waiting) == (2, 2)
