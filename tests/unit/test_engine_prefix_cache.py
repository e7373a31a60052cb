"""Prefix caching gives the same tokens as recomputing, and every KV page goes back to the pool when its
requests finish or are aborted."""
from __future__ import annotations

import pytest

from diffulex_backend import FinishReason, SamplingParams
from engine_driver import Stream, drain, run_requests, step_checked, tiny_engine

SYSTEM = "a shared system prompt that spans twelve pages: "  # 48 tokens (one per byte): 12 full pages of 4
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
FAMILIES = ["llada", "dream", "sdar"]


def without_prefix_cache(path, prompts):
    return [s.token_ids for s in run_requests(tiny_engine(path, enable_prefix_caching=False), prompts, PARAMS)]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hit_gives_same_tokens_as_miss(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    # A shared prefix, then the same prompt again. 61 tokens: the last one is always recomputed, so 15 of its
    # pages can be reused.
    prompts = [SYSTEM + "one, and more", SYSTEM + "two, and more", SYSTEM + "one, and more"]
    want = without_prefix_cache(path, prompts)

    llm = tiny_engine(path)
    got, hits = [], []
    for prompt in prompts:
        got.append(run_requests(llm, [prompt], PARAMS)[0].token_ids)
        hits.append(llm.metrics().prefix_cache_hit_tokens)

    assert got == want
    assert hits[0] == 0
    assert hits[1] - hits[0] == 48  # the system prompt's 12 pages
    assert hits[2] - hits[1] == 60  # the whole prompt but its last, partial page
    assert llm.metrics().kv_pages_used == 0


def test_prefix_caching_off_never_hits(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, enable_prefix_caching=False)
    run_requests(llm, [SYSTEM + "one"], PARAMS)
    run_requests(llm, [SYSTEM + "one"], PARAMS)
    assert llm.metrics().prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_pages_stay_until_their_last_user_is_done(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    want = without_prefix_cache(path, [SYSTEM + "two, and more"])[0]

    llm = tiny_engine(path)
    first = llm.add_request(SYSTEM + "one, and more", PARAMS)
    step_checked(llm)  # the first request's prompt is now cached
    second = llm.add_request(SYSTEM + "two, and more", PARAMS)
    streams = {first: Stream(first), second: Stream(second)}
    for delta in step_checked(llm):
        streams[delta.request_id].deltas.append(delta)
    assert llm.metrics().prefix_cache_hit_tokens == 48

    llm.abort(first)  # its pages are still the second request's prefix
    streams.pop(first)
    drain(llm, streams)
    assert streams[second].token_ids == want
    assert llm.metrics().kv_pages_used == 0


def test_evicted_prefix_pages_are_recomputed_not_reused(llada_checkpoint):
    # 40 pages: the second and third requests' pages evict the first one's cached prefix.
    llm = tiny_engine(llada_checkpoint, num_kv_pages=40)
    other = "a different prompt that fills the rest of the pool, page by page: "
    run_requests(llm, [SYSTEM + "one"], PARAMS)
    run_requests(llm, ["a: " + other, "b: " + other], PARAMS)  # no page in common: neither waits for the other
    before = llm.metrics().prefix_cache_hit_tokens
    again = run_requests(llm, [SYSTEM + "one"], PARAMS)[0]
    assert llm.metrics().prefix_cache_hit_tokens - before < 48
    assert again.token_ids == without_prefix_cache(llada_checkpoint, [SYSTEM + "one"])[0]


def test_pages_return_to_the_pool_after_finish_and_abort(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, max_num_reqs=2, accept_threshold=0.7)
    total = llm.metrics().kv_pages_total
    ids = [llm.add_request(SYSTEM + str(i), PARAMS) for i in range(4)]
    step_checked(llm)
    step_checked(llm)
    assert llm.metrics().kv_pages_used > 0
    llm.abort(ids[0])  # running
    llm.abort(ids[3])  # still waiting
    llm.abort("no such request")  # ignored
    streams = {rid: Stream(rid) for rid in ids[1:3]}
    drain(llm, streams)
    assert [s.finish_reason for s in streams.values()] == [FinishReason.LENGTH] * 2
    metrics = llm.metrics()
    assert (metrics.kv_pages_used, metrics.kv_pages_free, metrics.num_running, metrics.num_waiting) == (0, total, 0, 0)


def test_abort_in_the_middle_of_decoding_frees_everything_at_once(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, accept_threshold=0.9)
    rid = llm.add_request(SYSTEM, SamplingParams(max_tokens=32, ignore_eos=True))
    step_checked(llm)
    step_checked(llm)
    assert llm.metrics().kv_pages_used > 0
    llm.abort(rid)
    assert llm.metrics().kv_pages_used == 0
    assert not llm.has_unfinished_requests()
    assert llm.step() == []


@pytest.mark.parametrize("strategy", [dict(decoding_strategy="multi_bd"), dict(decoding_strategy="dmax"),
                                      dict(decoding_strategy="fast_dllm_v2", block_size=8, sub_block_size=4)],
                         ids=["multi_bd", "dmax", "fast_dllm_v2"])
def test_copies_of_one_prompt_sent_together_share_its_pages(llada_checkpoint, strategy):
    """n copies added at once: the first writes the prompt's pages and the others wait one step for them, so the
    hit counter rises by the prompt's pages times n - 1, and every copy decodes as it would alone."""
    n, prompt = 4, SYSTEM + "one, and more"
    llm = tiny_engine(llada_checkpoint, **strategy)
    alone = run_requests(llm, [prompt], PARAMS)[0].token_ids
    run_requests(llm, [prompt], PARAMS)
    prompt_pages_tokens = llm.metrics().prefix_cache_hit_tokens  # a whole hit: the prompt's cacheable pages

    llm = tiny_engine(llada_checkpoint, **strategy)  # a cold cache
    before = llm.metrics().prefix_cache_hit_tokens
    copies = run_requests(llm, [prompt] * n, PARAMS)
    assert [c.token_ids for c in copies] == [alone] * n
    assert prompt_pages_tokens >= 48
    assert llm.metrics().prefix_cache_hit_tokens - before == prompt_pages_tokens * (n - 1)
    assert llm.metrics().kv_pages_used == 0 and not llm.kv_cache.pending


def test_copies_run_on_their_own_without_a_prefix_cache(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, enable_prefix_caching=False, max_num_batched_tokens=256)
    streams = {rid: Stream(rid) for rid in (llm.add_request(SYSTEM + "one", PARAMS) for _ in range(3))}
    for delta in step_checked(llm):
        streams[delta.request_id].deltas.append(delta)
    assert len(llm.last_schedule.plans) == 3  # no copy waits for another
    drain(llm, streams)
    first, *others = streams.values()
    assert all(s.token_ids == first.token_ids for s in others)
    assert llm.metrics().prefix_cache_hit_tokens == 0
