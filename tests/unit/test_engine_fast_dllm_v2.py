"""fast_dllm_v2: token-exact against a plain reference of Fast-dLLM v2's sub-block decoding, and unchanged by
batching, preemption, page size and prefix reuse.

The reference recomputes the whole sequence at every step through a dense attention with an explicit
block-causal mask at absolute positions (test_engine_exactness.DenseModel), one request at a time: neither the
paged cache, the block-id encoding, the scheduler nor the batched acceptance takes part in it.
"""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from engine_driver import run_one_at_a_time, run_requests, tiny_engine
from test_engine_exactness import DenseModel

# Prompt lengths 19, 2, 16 and 50 under blocks of 8: a partial last prompt block, a prompt inside the first
# block, a prompt that ends on a block boundary (its first generated token is decoded alone), and a long one.
PROMPTS = ["The quick brown fox", "hi", "0123456789abcdef", "diffusion language models decode blocks in parallel"]


def absolute_block_causal_mask(n: int, block_size: int) -> torch.Tensor:
    """mask[i, j]: position i may attend to position j, i.e. j's block is not after i's; blocks start at
    multiples of block_size from position 0, prompt included."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return j // block_size <= i // block_size


def reference_fast_dllm_v2(dense, prompt, max_tokens, block_size, sub_block_size, threshold, mask_id):
    """Fast-dLLM v2's generation, greedy: blocks left to right, each decoded sub-block by sub-block; a block's
    first generated token, when the block starts after the prompt, is the argmax of the position before it."""
    p, n = len(prompt), len(prompt) + max_tokens
    x = torch.tensor(prompt + [mask_id] * max_tokens)
    for start in range(p // block_size * block_size, n, block_size):
        end = min(start + block_size, n)
        if start >= p:
            logits = dense.logits(x[:start + 1], absolute_block_causal_mask(start + 1, block_size))
            x[start] = logits[start].argmax()
        for sub in range(start, end, sub_block_size):
            while True:
                masked = [i for i in range(max(sub, p), min(sub + sub_block_size, end)) if x[i] == mask_id]
                if not masked:
                    break
                probs = dense.logits(x[:end], absolute_block_causal_mask(end, block_size)).softmax(-1)
                conf, pred = probs.max(-1)
                take = [i for i in masked if conf[i] >= threshold] or [max(masked, key=lambda i: (conf[i], -i))]
                x[take] = pred[take]
    return x[p:].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_random_checkpoint(tmp_path_factory.mktemp("fast_dllm_v2"), "fast_dllm_v2", seed=3))


def dense_model(path, mask_token_id):
    dense = DenseModel(path)
    dense.mask_token_id = mask_token_id  # the family's config.json names none; the tokenizer does
    return dense


def engine(path, **overrides):
    return tiny_engine(path, **{**dict(decoding_strategy="fast_dllm_v2", block_size=8, sub_block_size=4,
                                       accept_threshold=0.3), **overrides})


@pytest.mark.parametrize("sub_block_size,page_size", [(4, 4), (2, 8), (8, 16), (1, 4)])
def test_fast_dllm_v2_matches_the_sub_block_reference(checkpoint, sub_block_size, page_size):
    max_tokens, threshold = 21, 0.3  # the generation area ends inside a block
    llm = engine(checkpoint, sub_block_size=sub_block_size, page_size=page_size, enable_prefix_caching=False)
    outs = run_requests(llm, PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    dense = dense_model(checkpoint, llm.config.mask_token_id)
    for prompt, out in zip(PROMPTS, outs):
        want = reference_fast_dllm_v2(dense, llm.tokenizer.encode(prompt), max_tokens, 8, sub_block_size, threshold,
                                      llm.config.mask_token_id)
        assert out.token_ids == want, prompt
    if sub_block_size > 1:
        parallel = sum(len(o.token_ids) for o in outs) / sum(o.nfe for o in outs)
        assert parallel > 1.2, "the threshold should accept several tokens per forward, else this test proves little"
    assert llm.metrics().kv_pages_used == 0


def test_request_sub_block_size_overrides_the_engine_setting(checkpoint):
    params = SamplingParams(max_tokens=16, ignore_eos=True, sub_block_size=2)
    got = [s.token_ids for s in run_requests(engine(checkpoint, sub_block_size=8), PROMPTS, params)]
    want = [s.token_ids for s in run_requests(engine(checkpoint, sub_block_size=2), PROMPTS,
                                              SamplingParams(max_tokens=16, ignore_eos=True))]
    assert got == want
    assert got != [s.token_ids for s in run_requests(engine(checkpoint, sub_block_size=8), PROMPTS,
                                                     SamplingParams(max_tokens=16, ignore_eos=True))]


def test_outputs_do_not_depend_on_batching_or_preemption(checkpoint):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [s.token_ids for s in run_one_at_a_time(engine(checkpoint), PROMPTS, params)]
    assert [s.token_ids for s in run_requests(engine(checkpoint), PROMPTS, params)] == alone
    # A token budget that splits prefills, so that forwards mix chunks, commits and sub-blocks.
    assert [s.token_ids for s in run_requests(engine(checkpoint, max_num_batched_tokens=24), PROMPTS, params)] == alone
    small = engine(checkpoint, num_kv_pages=17)  # the largest request needs 17
    assert [s.token_ids for s in run_requests(small, PROMPTS, params)] == alone
    assert small.metrics().num_preemptions > 0
    assert small.metrics().kv_pages_used == 0


@pytest.mark.parametrize("page_size", [2, 4, 8, 16, 12])  # smaller than, equal to, larger than, unaligned to a block
def test_prefix_cache_hit_gives_same_tokens_as_miss(checkpoint, page_size):
    system = "a shared system prompt, 45 tokens long, then "  # five whole blocks of 8, and 5 tokens
    prompts = [system + "one", system + "two", system + "one"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [s.token_ids for s in run_one_at_a_time(engine(checkpoint, enable_prefix_caching=False), prompts, params)]
    llm = engine(checkpoint, page_size=page_size)
    got, hits = [], []
    for prompt in prompts:
        got.append(run_requests(llm, [prompt], params)[0].token_ids)
        hits.append(llm.metrics().prefix_cache_hit_tokens)
    assert got == want
    unit = {2: 8, 4: 8, 8: 8, 16: 16, 12: 24}[page_size]  # hits end on a page and a block boundary
    assert hits[0] == 0
    assert hits[1] == 40 // unit * unit  # the shared whole blocks
    assert hits[2] - hits[1] == 40 // unit * unit  # the pages of its first 47 tokens, cut to whole blocks
    assert llm.metrics().kv_pages_used == 0


def test_prefix_pages_of_a_partial_prompt_block_are_never_reused(checkpoint):
    # The two prompts share 13 tokens: one whole block and most of the next, whose K/V depend on the rest of it.
    prompts = ["0123456789ab one more", "0123456789ab two more"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [s.token_ids for s in run_one_at_a_time(engine(checkpoint, enable_prefix_caching=False), prompts, params)]
    llm = engine(checkpoint, page_size=4)
    assert [s.token_ids for s in run_one_at_a_time(llm, prompts, params)] == want
    assert llm.metrics().prefix_cache_hit_tokens == 8


@pytest.mark.parametrize("overrides,message", [
    (dict(block_size=8, sub_block_size=3), "'sub_block_size' (3) must divide block_size (8)"),
    (dict(block_size=4), "'sub_block_size' (8) must divide block_size (4)"),
    (dict(sub_block_size=0), "'sub_block_size' must be an integer >= 1"),
    (dict(sampling_mode="topk"), "'sampling_mode' must be 'threshold'"),
    (dict(remask_threshold=0.5), "'remask_threshold' must be 0"),
    (dict(buffer_size=2), "'buffer_size' must be <= 1"),
    (dict(dual_cache=True), "applies to decoding_strategy 'fast_dllm' only"),
    (dict(max_num_batched_tokens=8), "'max_num_batched_tokens' must be >= 9"),
])
def test_config_errors_name_the_field(checkpoint, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Diffulex(checkpoint, **{**dict(decoding_strategy="fast_dllm_v2", block_size=8, device="cpu"), **overrides})


def test_request_sub_block_size_must_divide_the_block(checkpoint):
    llm = engine(checkpoint)
    with pytest.raises(ValueError, match=r"sampling parameter 'sub_block_size' \(3\) must divide block_size \(8\)"):
        llm.add_request("hi", SamplingParams(max_tokens=8, sub_block_size=3))
    with pytest.raises(ValueError, match="'sub_block_size' must be an integer"):
        SamplingParams(sub_block_size=0)
    assert not llm.has_unfinished_requests()


def test_a_request_remask_threshold_is_refused_since_nothing_would_read_it(checkpoint):
    llm = engine(checkpoint)
    with pytest.raises(ValueError, match="'remask_threshold' must be 0 or null for decoding_strategy 'fast_dllm_v2'"):
        llm.add_request("hi", SamplingParams(max_tokens=8, remask_threshold=0.5))
    assert not llm.has_unfinished_requests()


def test_a_request_retention_ratio_is_refused_since_the_strategy_drops_no_pages(checkpoint):
    """fast_dllm_v2's own check once skipped the base checks: a retention_ratio of 0.5 was accepted and dropped
    prompt pages, although the strategy keeps every page."""
    llm = engine(checkpoint)
    with pytest.raises(ValueError, match="'retention_ratio' must be 1 or null for decoding_strategy 'fast_dllm_v2'"):
        llm.add_request("a prompt long enough to fill several pages", SamplingParams(max_tokens=8,
                                                                                       retention_ratio=0.5))
    assert not llm.has_unfinished_requests() and llm.kv_cache.num_used_pages == 0


def test_request_sub_block_size_is_refused_by_other_strategies(checkpoint):
    llm = tiny_engine(checkpoint, decoding_strategy="multi_bd")
    with pytest.raises(ValueError, match="applies to decoding_strategy 'fast_dllm_v2' only, not 'multi_bd'"):
        llm.add_request("hi", SamplingParams(max_tokens=8, sub_block_size=2))


def test_committed_eos_ends_the_stream(checkpoint):
    # Greedy decoding of this prompt and threshold reaches EOS; the reference says where.
    llm = engine(checkpoint)
    dense = dense_model(checkpoint, llm.config.mask_token_id)
    for prompt in PROMPTS:
        out = run_requests(llm, [prompt], SamplingParams(max_tokens=40))[0]
        full = reference_fast_dllm_v2(dense, llm.tokenizer.encode(prompt), 40, 8, 4, 0.3, llm.config.mask_token_id)
        eos = llm.eos_token_ids[0]
        assert out.token_ids == (full[:full.index(eos)] if eos in full else full)


def test_config_pbtxt_settings_and_request_overrides_reach_the_strategy(checkpoint, tmp_path):
    from diffulex_backend.serving.engine_settings import engine_settings

    parameters = {"model": checkpoint, "decoding_strategy": "fast_dllm_v2", "block_size": "8", "sub_block_size": "8",
                  "page_size": "4", "max_model_len": "96", "max_num_batched_tokens": "128", "dtype": "float64",
                  "device": "cpu", "accept_threshold": "0.9"}
    settings = {k: {"string_value": v} for k, v in parameters.items()}
    llm = Diffulex(**engine_settings(settings, tmp_path))
    params = SamplingParams.from_dict({"max_tokens": 21, "ignore_eos": True, "sub_block_size": 2,
                                       "accept_threshold": 0.3})
    stream = run_requests(llm, [PROMPTS[0]], params)[0]
    assert stream.token_ids == run_requests(engine(checkpoint, sub_block_size=2), [PROMPTS[0]], params)[0].token_ids
    # One delta per committed block: the rest of the prompt's last block (19 tokens: 5), then blocks of 8.
    assert [len(d.token_ids) for d in stream.deltas] == [5, 8, 8]
