"""min_tokens, as vLLM has it: EOS and stop tokens cannot be sampled at the first min_tokens output positions, so a
model that would end early writes on. A block decodes its positions in parallel, so the position's index in the
output decides, not the step."""
from __future__ import annotations

import pytest

from checkpoint_edits import edit_output_head
from diffulex_backend import FinishReason, SamplingParams
from diffulex_backend.refusal import Refusal
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID, write_random_checkpoint
from engine_driver import run_requests, tiny_engine

PROMPTS = ["hello", "12+34="]
STRATEGIES = [
    dict(decoding_strategy="multi_bd", buffer_size=2),
    dict(decoding_strategy="vanilla"),
    dict(decoding_strategy="fast_dllm"),
    dict(decoding_strategy="fast_dllm_v2", sub_block_size=2),
    dict(decoding_strategy="dmax"),
]
IDS = [s["decoding_strategy"] for s in STRATEGIES]


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory):
    """A llada checkpoint whose head scores EOS at three times the logit of the token the unedited model decodes
    first, so EOS tops many positions of the output."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("eos_early") / "llada", "llada")
    first = run_requests(tiny_engine(str(path)), ["hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0]

    def favour_eos(weight):
        weight[EOS_TOKEN_ID] = 3 * weight[first.token_ids[0]]

    edit_output_head(path, "llada", favour_eos)
    return str(path)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
def test_a_model_that_would_end_early_writes_at_least_min_tokens(eos_checkpoint, strategy):
    llm = tiny_engine(eos_checkpoint, **strategy)
    free = run_requests(llm, PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    ends = [s.token_ids.index(EOS_TOKEN_ID) for s in free if EOS_TOKEN_ID in s.token_ids]
    assert ends and min(ends) < 6, "the edited model should put EOS early, else this test proves nothing"

    held = run_requests(llm, PROMPTS, SamplingParams(max_tokens=16, min_tokens=6))
    for stream in held:
        assert len(stream.token_ids) >= 6
        assert EOS_TOKEN_ID not in stream.token_ids  # the output stops before an EOS after min_tokens
        if stream.finish_reason == FinishReason.STOP:
            assert len(stream.token_ids) < 16
    assert llm.metrics().kv_pages_used == 0


def test_eos_right_after_min_tokens_ends_the_request(eos_checkpoint):
    llm = tiny_engine(eos_checkpoint)
    free = run_requests(llm, ["hello"], SamplingParams(max_tokens=16))[0]
    assert free.finish_reason == FinishReason.STOP and free.token_ids == []  # EOS first: nothing to output
    for min_tokens in (1, 3, 4, 5):  # inside the first block, at its end, and one into the second
        ended = run_requests(llm, ["hello"], SamplingParams(max_tokens=16, min_tokens=min_tokens))[0]
        assert ended.finish_reason == FinishReason.STOP
        assert min_tokens <= len(ended.token_ids) < 16


def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_request(llada_checkpoint):
    """As vLLM's detokenizer has it: a stop string counts only where its match ends past the first min_tokens
    tokens' text."""
    llm = tiny_engine(llada_checkpoint, max_model_len=64)
    free = run_requests(llm, ["hi"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    texts = [llm.tokenizer.decode([t]) for t in free.token_ids]
    stop = texts[1]
    assert stop.isprintable() and stop not in "".join(texts[2:]) and stop not in texts[0], "pick another token"
    early = run_requests(llm, ["hi"], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert early.token_ids == free.token_ids[:2] and early.finish_reason == FinishReason.STOP
    held = run_requests(llm, ["hi"], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=4))[0]
    assert held.token_ids == free.token_ids and held.text == free.text and held.finish_reason == FinishReason.LENGTH


def test_a_ban_that_leaves_no_token_to_sample_is_refused_by_name_and_changes_nothing(eos_checkpoint):
    """min_tokens bans the stop and EOS ids from the first positions, and the mask token is never sampled: stop ids
    that are every other token leave those positions nothing to take (their log-probabilities would be NaN). Such a
    request is refused, naming the parameters; one token left unbanned is served, and takes every position the ban
    covers; the engine serves the next request as before."""
    llm = tiny_engine(eos_checkpoint)
    vocab, mask = llm.model.arch.vocab_size, llm.config.mask_token_id
    before = run_requests(llm, ["hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    everything = [t for t in range(vocab) if t != mask]
    with pytest.raises(Refusal, match=rf"sampling parameter 'stop_token_ids' leaves no token to sample under "
                                      rf"min_tokens \(4\): .* every token of the {vocab} but the mask token"):
        llm.add_request("hello", SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=everything, logprobs=1))
    left = everything.pop(3)
    held = run_requests(llm, ["hello"], SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=everything,
                                                       logprobs=1))[0]
    assert held.token_ids[:4] == [left] * 4
    assert run_requests(llm, ["hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids == before
    assert llm.metrics().kv_pages_used == 0
