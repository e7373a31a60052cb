"""fast_dllm: with its cache refreshed at every step it is vanilla with threshold acceptance, token for token;
its cached modes decode every token for fewer model FLOPs than vanilla."""
from __future__ import annotations

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID
from engine_driver import run_requests, tiny_engine

PROMPTS = ["hello world", "the quick brown fox", "ab"]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
# accept 0.5 decodes several tokens in some steps and one in others, so the acceptance rule matters.
LIMITS = dict(block_size=8, accept_threshold=0.5)


def decode(path, **strategy):
    llm = tiny_engine(path, **LIMITS, **strategy)
    streams = run_requests(llm, PROMPTS, PARAMS)
    return [s.token_ids for s in streams], [s.nfe for s in streams], llm.metrics()


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("dual_cache", [False, True])
def test_fast_dllm_refreshed_every_step_equals_vanilla_with_threshold_acceptance(tiny_checkpoints, family, dual_cache):
    path = tiny_checkpoints[family]
    want, want_nfe, _ = decode(path, decoding_strategy="vanilla", sampling_mode="threshold")
    got, got_nfe, _ = decode(path, decoding_strategy="fast_dllm", cache_refresh_interval=1, dual_cache=dual_cache)
    assert got == want
    assert got_nfe == want_nfe
    assert min(len(t) for t in want) * len(want) > sum(want_nfe), "some step should accept several tokens"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cached_modes_decode_every_token_for_fewer_flops_than_vanilla(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    _, vanilla_nfe, vanilla = decode(path, decoding_strategy="vanilla", sampling_mode="threshold")
    prefix_tokens, _, prefix = decode(path, decoding_strategy="fast_dllm")
    dual_tokens, _, dual = decode(path, decoding_strategy="fast_dllm", dual_cache=True)
    for outputs in (prefix_tokens, dual_tokens):
        assert [len(t) for t in outputs] == [24] * len(PROMPTS)
        assert all(MASK_TOKEN_ID not in t for t in outputs)
    assert prefix.model_flops < vanilla.model_flops
    assert dual.model_flops < prefix.model_flops  # the suffix is cached too
    assert prefix.num_forward_tokens < vanilla.num_forward_tokens
    assert prefix.kv_pages_used == dual.kv_pages_used == 0


def test_refresh_interval_trades_flops_for_freshness(llada_checkpoint):
    flops = [decode(llada_checkpoint, decoding_strategy="fast_dllm", cache_refresh_interval=n)[2].model_flops
             for n in (1, 2, 0)]
    assert flops[0] > flops[1] > flops[2]
