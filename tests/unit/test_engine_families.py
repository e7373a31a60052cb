"""Dream (shifted: position i predicts token i + 1) and SDAR (block-causal Qwen3) through multi_bd and d2f: the
paged cache, its page size, prefix reuse, batching and preemption leave their tokens unchanged."""
from __future__ import annotations

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID as MASK_ID
from engine_driver import run_one_at_a_time, run_requests, tiny_engine

SYSTEM = "a shared prefix of sixteen tokens"[:16]
PROMPTS = [SYSTEM + " and one", "the quick brown fox", SYSTEM + " and two", "ab"]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=PARAMS):
    return [s.token_ids for s in run_requests(llm, prompts, params)]


@pytest.mark.parametrize("family", ["dream", "sdar"])
@pytest.mark.parametrize("strategy", ["multi_bd", "d2f"])
def test_outputs_do_not_depend_on_batching_or_preemption(tiny_checkpoints, family, strategy):
    path = tiny_checkpoints[family]
    config = dict(decoding_strategy=strategy, buffer_size=2, accept_threshold=0.5, max_num_batched_tokens=256)
    alone = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, **config), PROMPTS, PARAMS)]
    assert all(len(t) == 16 and MASK_ID not in t for t in alone)
    assert tokens(tiny_engine(path, **config)) == alone
    small = tiny_engine(path, num_kv_pages=11, **config)  # the largest request needs 10
    assert tokens(small) == alone
    assert small.metrics().num_preemptions > 0


@pytest.mark.parametrize("family", ["dream", "sdar"])
@pytest.mark.parametrize("buffer_size", [1, 3])
def test_page_size_and_prefix_reuse_leave_multi_bd_tokens_unchanged(tiny_checkpoints, family, buffer_size):
    path = tiny_checkpoints[family]
    config = dict(buffer_size=buffer_size, accept_threshold=0.5)
    # One request at a time, so that the later prompts find the earlier ones' pages in the prefix cache.
    want = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, enable_prefix_caching=False, **config),
                                                     PROMPTS, PARAMS)]
    for page_size in (2, 4, 8):  # smaller than, equal to and larger than the block
        llm = tiny_engine(path, page_size=page_size, **config)
        assert [s.token_ids for s in run_one_at_a_time(llm, PROMPTS, PARAMS)] == want, f"page_size={page_size}"
        assert llm.metrics().prefix_cache_hit_tokens >= 16  # the third prompt reuses the first one's prefix
        assert llm.metrics().kv_pages_used == 0


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_d2f_differs_from_multi_bd_only_through_the_prompt_attention(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    config = dict(buffer_size=2, accept_threshold=0.5)
    # A one-token prompt has no attention inside it to open up: the two strategies decode alike.
    one_token = ["x", "y", "z"]
    assert tokens(tiny_engine(path, decoding_strategy="d2f", **config), one_token) == \
        tokens(tiny_engine(path, decoding_strategy="multi_bd", **config), one_token)
    # Longer prompts attend bidirectionally under d2f, so their outputs change.
    assert tokens(tiny_engine(path, decoding_strategy="d2f", **config)) != \
        tokens(tiny_engine(path, decoding_strategy="multi_bd", **config))
