"""A model may put the mask token first at a masked position (random or poorly trained weights do). Decoding must
still end, and the mask token is never part of an output."""
from __future__ import annotations

import pytest

from checkpoint_edits import edit_output_head
from diffulex_backend import FinishReason, SamplingParams
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, write_random_checkpoint
from engine_driver import run_requests, tiny_engine

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def mask_predicting_checkpoint(tmp_path_factory):
    """A llada checkpoint whose head scores the mask token at twice the logit of the token that the unedited
    model decodes first, so the mask token tops that position's distribution."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("mask_predicting") / "llada", "llada")
    first = run_requests(tiny_engine(str(path), accept_threshold=1.0), ["hello"], PARAMS)[0].token_ids[0]

    def favour_mask(weight):
        weight[MASK_TOKEN_ID] = 2 * weight[first]

    edit_output_head(path, "llada", favour_mask)
    return str(path)


@pytest.mark.parametrize("strategy", [
    dict(decoding_strategy="multi_bd", buffer_size=2),
    dict(decoding_strategy="d2f"),
    dict(decoding_strategy="vanilla"),
    dict(decoding_strategy="fast_dllm"),
    dict(decoding_strategy="fast_dllm_v2", sub_block_size=2),
], ids=["multi_bd", "d2f", "vanilla", "fast_dllm", "fast_dllm_v2"])
def test_a_model_that_predicts_the_mask_token_still_finishes_without_it(mask_predicting_checkpoint, strategy):
    llm = tiny_engine(mask_predicting_checkpoint, **strategy)
    stream = run_requests(llm, ["hello"], PARAMS, max_steps=64)[0]
    assert stream.finish_reason == FinishReason.LENGTH
    assert len(stream.token_ids) == 8
    assert MASK_TOKEN_ID not in stream.token_ids
