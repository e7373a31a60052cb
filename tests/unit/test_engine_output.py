"""What a user reads back: greedy decoding repeats itself, EOS, stop tokens and stop strings end a request with
nothing after them, and streamed text is append-only, holding back a UTF-8 character until it is complete."""
from __future__ import annotations

import json
import shutil

import pytest

from diffulex_backend import FinishReason, SamplingParams
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID
from engine_driver import TINY_LIMITS, run_requests, tiny_engine

PROMPTS = ["hello world", "the quick brown fox", "ab", "diffusion"]
FREE = SamplingParams(max_tokens=24, ignore_eos=True)
CONFIG = dict(buffer_size=3, accept_threshold=0.7)  # blocks after the stop are in flight when it commits


def free_run(path):
    return run_requests(tiny_engine(path, **CONFIG), PROMPTS, FREE)


def a_stop_token(token_ids: list[int], block_size: int = 4) -> tuple[int, int]:
    """A token of the output and its first index: not the first token, and not at the start of a block, so the
    stop cuts a block in two."""
    for i, t in enumerate(token_ids):
        if i >= 1 and i % block_size and t not in token_ids[:i]:
            return t, i
    raise AssertionError(f"no token of {token_ids} can serve as a stop token")


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_greedy_decoding_is_deterministic(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    first = [s.token_ids for s in free_run(path)]
    assert [s.token_ids for s in free_run(path)] == first
    assert [o.token_ids for o in tiny_engine(path, **CONFIG).generate(PROMPTS, FREE)] == first


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_committed_eos_ends_the_request_and_nothing_after_it_is_returned(tiny_checkpoints, family, tmp_path):
    free = free_run(tiny_checkpoints[family])
    # A copy of the checkpoint whose config.json lists, as instruct models do, a second EOS id: one that each
    # output holds in the middle of a block.
    path = shutil.copytree(tiny_checkpoints[family], tmp_path / family)
    config = json.loads((path / "config.json").read_text())
    extra = [a_stop_token(s.token_ids)[0] for s in free]
    config["eos_token_id"] = [EOS_TOKEN_ID, *extra]
    (path / "config.json").write_text(json.dumps(config))

    llm = tiny_engine(str(path), **CONFIG)
    assert set(llm.eos_token_ids) == {EOS_TOKEN_ID, *extra}
    stopped = run_requests(llm, PROMPTS, SamplingParams(max_tokens=24))
    for s, want in zip(stopped, free):
        end = min(i for i, t in enumerate(want.token_ids) if t in llm.eos_token_ids)
        assert s.token_ids == want.token_ids[:end]
        assert s.text == llm.tokenizer.decode(want.token_ids[:end])
        assert s.finish_reason == FinishReason.STOP
    assert llm.metrics().kv_pages_used == 0
    # ignore_eos decodes through it.
    assert [s.token_ids for s in run_requests(llm, PROMPTS, FREE)] == [s.token_ids for s in free]


def test_stop_token_ids_end_the_request_before_the_stop_token(llada_checkpoint):
    free = free_run(llada_checkpoint)
    llm = tiny_engine(llada_checkpoint, **CONFIG)
    for want in free:
        token, index = a_stop_token(want.token_ids)
        out = llm.generate(PROMPTS[free.index(want)], SamplingParams(max_tokens=24, ignore_eos=True,
                                                                     stop_token_ids=[token]))[0]
        assert out.token_ids == want.token_ids[:index]
        assert out.finish_reason == FinishReason.STOP


def test_stop_string_ends_the_text_at_its_first_match_even_across_deltas(llada_checkpoint):
    free = free_run(llada_checkpoint)
    llm = tiny_engine(llada_checkpoint, **CONFIG)
    straddling = cut_blocks = 0
    for prompt, want in zip(PROMPTS, free):
        boundaries = {sum(len(d.text) for d in want.deltas[:n]) for n in range(1, len(want.deltas))}
        text = want.text
        # Two-character stop strings that first occur at k, preferring those split across two deltas.
        candidates = [k for k in range(1, len(text) - 1)
                      if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k]
        split = [k for k in candidates if k + 1 in boundaries]
        k = (split or candidates)[0]
        straddling += bool(split)
        stop = text[k:k + 2]
        out = run_requests(llm, [prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
        assert out.text == text[:k]
        assert out.finish_reason == FinishReason.STOP
        # The tokens end with the one that completes the match: none of the block after it is output.
        through = next(n for n in range(len(want.token_ids) + 1)
                       if stop in llm.tokenizer.decode(want.token_ids[:n], skip_special_tokens=True))
        assert out.token_ids == want.token_ids[:through]
        assert out.deltas[-1].num_output_tokens == through
        cut_blocks += bool(through % TINY_LIMITS["block_size"])
    assert straddling, "no stop string straddled two deltas; pick other prompts"
    assert cut_blocks, "every stop string ended a block, so no tokens had to be dropped; pick other prompts"


def test_streamed_text_is_append_only_and_holds_back_split_utf8(llada_checkpoint):
    # Sampling at a high temperature from one-byte tokens, two tokens per block: multi-byte characters appear,
    # and some are split between two blocks.
    llm = tiny_engine(llada_checkpoint, block_size=2, accept_threshold=0.0)
    params = [SamplingParams(max_tokens=32, ignore_eos=True, temperature=5.0, seed=s) for s in range(8)]
    streams = run_requests(llm, ["utf8 "] * 8, params)
    split_characters = 0
    for s in streams:
        assert s.text == llm.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        for delta in s.deltas[:-1]:
            assert not delta.text.endswith("\ufffd"), f"a partial character was sent in {delta.text!r}"
        # A character is split when a prefix of the bytes decodes to a trailing U+FFFD that the whole output
        # turns into a real character.
        ids = []
        for delta in s.deltas[:-1]:
            ids += delta.token_ids
            head = llm.tokenizer.decode(ids, skip_special_tokens=True)
            sent = len(head.rstrip("\ufffd"))
            split_characters += head.endswith("\ufffd") and s.text[sent:sent + 1] not in ("", "\ufffd")
    assert split_characters >= 1, "no multi-byte character was split between blocks; the test proves nothing"
