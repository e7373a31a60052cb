"""Log-probabilities: each output token's is the log-softmax of the logits of the forward that unmasked it, and the
top tokens come from that same forward; a request that does not ask gets none and the same tokens."""
from __future__ import annotations

import math

import pytest
import torch

from diffulex_backend import SamplingParams
from engine_driver import run_requests, tiny_engine
from test_engine_exactness import DenseModel

PROMPTS = ["The quick brown fox", "12+34="]
TOP_N = 3


def reference_llada_logprobs(dense, prompt, gen_length, block_length, steps, mask_id, top_n):
    """LLaDA's greedy sampler (test_engine_exactness.reference_llada), recording for each generated position the
    log_softmax of the logits of the step that unmasked it: its token's value and the top_n most likely tokens."""
    p = len(prompt)
    x = torch.tensor(prompt + [mask_id] * gen_length)
    full = torch.ones(len(x), len(x), dtype=torch.bool)
    chosen, top = [None] * gen_length, [None] * gen_length
    for b in range(gen_length // block_length):
        s, e = p + b * block_length, p + (b + 1) * block_length
        base, extra = divmod(int((x[s:e] == mask_id).sum()), steps)
        for i in range(steps):
            k = base + (1 if i < extra else 0)
            logprobs = torch.log_softmax(dense.logits(x, full), dim=-1)
            x0 = logprobs.argmax(-1)
            confidence = torch.where(x == mask_id, logprobs.gather(1, x0[:, None]).squeeze(1).exp(),
                                     torch.tensor(float("-inf", )))
            confidence[e:] = float("-inf")
            for pos in torch.sort(confidence, descending=True, stable=True).indices[:k].tolist():
                x[pos] = x0[pos]
                chosen[pos - p] = float(logprobs[pos, x0[pos]])
                values, ids = logprobs[pos].topk(top_n)
                top[pos - p] = dict(zip(ids.tolist(), values.tolist()))
    return x[p:].tolist(), chosen, top


@pytest.fixture(scope="module")
def vanilla(llada_checkpoint):
    return tiny_engine(llada_checkpoint, decoding_strategy="vanilla", block_size=8, max_model_len=64)


def test_logprobs_are_the_log_softmax_of_the_step_that_unmasked_each_token(vanilla, llada_checkpoint):
    dense = DenseModel(llada_checkpoint)
    params = SamplingParams(max_tokens=16, steps=4, ignore_eos=True, logprobs=TOP_N)
    for prompt, out in zip(PROMPTS, vanilla.generate(PROMPTS, params)):
        tokens, chosen, top = reference_llada_logprobs(dense, vanilla.tokenizer.encode(prompt), 16, 8, 4,
                                                       vanilla.config.mask_token_id, TOP_N)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(chosen, rel=1e-5, abs=1e-6)
        assert [list(t) for t in out.top_logprobs] == [list(t) for t in top]
        for got, want in zip(out.top_logprobs, top):
            assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5, abs=1e-6)
        # Several tokens share a step (4 steps for 8 positions), so this checks more than one token per forward.
        assert out.nfe == 8


def test_a_request_that_does_not_ask_gets_none_and_the_same_tokens(vanilla):
    asking = SamplingParams(max_tokens=16, steps=4, ignore_eos=True, logprobs=0)
    plain = SamplingParams(max_tokens=16, steps=4, ignore_eos=True)
    both = run_requests(vanilla, PROMPTS, [asking, plain])
    alone = run_requests(vanilla, PROMPTS, plain)
    assert [s.token_ids for s in both] == [s.token_ids for s in alone]
    assert all(d.logprobs is None and d.top_ids is None for s in [both[1], *alone] for d in s.deltas)
    asked = [d for d in both[0].deltas]
    assert sum(len(d.logprobs) for d in asked) == len(both[0].token_ids)
    assert all(d.top_ids is None for d in asked)  # logprobs=0: the token's own only
    assert all(lp <= 0 and math.isfinite(lp) for d in asked for lp in d.logprobs.tolist())


@pytest.mark.parametrize("strategy", [dict(decoding_strategy="multi_bd"), dict(decoding_strategy="dmax"),
                                      dict(decoding_strategy="fast_dllm")])
def test_greedy_logprobs_are_the_top_token_and_agree_with_the_batch(llada_checkpoint, strategy):
    """Under every kind of strategy, a greedy token is the most likely of the step that set it, so its logprob is the
    first top value; a request's logprobs do not depend on what else shares its batch."""
    llm = tiny_engine(llada_checkpoint, accept_threshold=0.05, **strategy)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    together = run_requests(llm, PROMPTS, params)
    for prompt, stream in zip(PROMPTS, together):
        ids = stream.token_ids
        logprobs = [lp for d in stream.deltas for lp in d.logprobs.tolist()]
        top_ids = [row for d in stream.deltas for row in d.top_ids.tolist()]
        top_lps = [row for d in stream.deltas for row in d.top_logprobs.tolist()]
        assert len(logprobs) == len(ids) == 12
        assert [row[0] for row in top_ids] == ids
        assert logprobs == pytest.approx([row[0] for row in top_lps])
        assert all(a >= b for a, b in top_lps)
        alone = run_requests(llm, [prompt], params)[0]
        assert [lp for d in alone.deltas for lp in d.logprobs.tolist()] == pytest.approx(logprobs)
    assert llm.metrics().kv_pages_used == 0


def test_logprobs_out_of_range_are_refused_by_name():
    for value in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="sampling parameter 'logprobs' must be an integer in \\[0, 20\\] or null"):
            SamplingParams(logprobs=value)


def test_two_ranks_give_the_logprobs_and_min_tokens_of_one(tmp_path):
    """Under tensor parallelism a greedy step samples from each rank's share of the logits, unless a request needs the
    whole rows: one that asks for logprobs, or bans tokens for min_tokens. Two ranks give one rank's numbers."""
    from diffulex_backend import Diffulex
    from diffulex_backend.testing.checkpoint import write_random_checkpoint

    checkpoint = str(write_random_checkpoint(tmp_path / "llada", "llada", vocab_size=259))  # the last rank pads
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, min_tokens=9, stop_token_ids=[5, 6])]
    out = {}
    for size in (1, 2):
        engine = Diffulex(checkpoint, dtype="float64", max_num_reqs=4, max_model_len=64, tensor_parallel_size=size)
        try:
            out[size] = engine.generate([[5, 6, 7, 8, 9], [11, 12, 13]], params)
        finally:
            engine.close()
    assert [o.token_ids for o in out[2]] == [o.token_ids for o in out[1]]
    assert out[2][0].logprobs == pytest.approx(out[1][0].logprobs, abs=1e-6)
    assert out[2][0].top_logprobs == [{k: pytest.approx(v, abs=1e-6) for k, v in t.items()}
                                      for t in out[1][0].top_logprobs]
    assert len(out[2][1].token_ids) >= 9 and not {5, 6} & set(out[2][1].token_ids[:9])
