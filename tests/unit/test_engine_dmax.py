"""dmax: soft parallel decoding. Without token merge and editing it is block diffusion token for token; with them,
the rows it feeds are the hand-computed mixture of the last step's predictions, and an edited block commits only
once it is stable. Outputs do not depend on batching, preemption or the padded (CUDA-graph) layout."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.cuda_graph import PaddedForward
from engine_driver import run_one_at_a_time, run_requests, tiny_engine

PROMPTS = ["The quick brown fox", "hi", "diffusion language models decode blocks in parallel"]
PARAMS = SamplingParams(max_tokens=14, ignore_eos=True)


def dmax(path, **overrides):
    return tiny_engine(path, **{"decoding_strategy": "dmax", "accept_threshold": 0.3, **overrides})


def tokens(llm, prompts=PROMPTS, params=PARAMS):
    return [s.token_ids for s in run_requests(llm, prompts, params)]


@pytest.mark.parametrize("model_name", ["llada", "dream"])  # dream: shifted logits
@pytest.mark.parametrize("buffer_size", [1, 2])
def test_without_token_merge_or_editing_dmax_is_multi_bd(tiny_checkpoints, model_name, buffer_size):
    path = tiny_checkpoints[model_name]
    # The thresholds that join and enable blocks act with a second block in flight only, and are refused without.
    thresholds = dict(add_block_threshold=0.25, semi_complete_threshold=0.5) if buffer_size > 1 else {}
    extra = dict(buffer_size=buffer_size, **thresholds)
    expected = tokens(tiny_engine(path, decoding_strategy="multi_bd", accept_threshold=0.3, **extra))
    assert tokens(dmax(path, token_merge_weight=0.0, edit_threshold=0.0, **extra)) == expected
    # Soft inputs change what the model sees, so the default settings decode differently on a random model.
    assert tokens(dmax(path, **extra)) != expected


class StepRecorder:
    """Per step: the plan fed, the rows the first layer got (the input embeddings), and the logits of the
    predicted positions as the sampler saw them (mask token excluded)."""

    def __init__(self, llm):
        self.llm, self.embeds, self.logits = llm, [], []
        model = llm.model
        model.layers[0].register_forward_pre_hook(lambda module, args: self.embeds.append(args[0].clone()))
        compute_logits = model.compute_logits

        def recording(hidden):
            out = compute_logits(hidden)
            logits = out.clone()
            logits[:, llm.config.mask_token_id] = float("-inf")
            self.logits.append(logits)
            return out

        model.compute_logits = recording

    def step(self):
        self.llm.step()
        return self.llm.last_schedule.plans[0]


def hand_mixture(table, token, ids, probs, mask_id, weight, renormalize):
    e, m = table[token], table[mask_id]
    rest = max(0.0, 1.0 - sum(probs))
    x = sum(p * table[i] for i, p in zip(ids, probs)) + rest * m
    if renormalize:
        target = sum(p * table[i].norm() for i, p in zip(ids, probs)) + rest * m.norm()
        x = x * target / x.norm()
    return e + weight * (x - e)


@pytest.mark.parametrize("top_k,weight,renormalize", [(1, 1.0, True), (2, 0.7, True), (3, 0.5, False)])
def test_fed_rows_are_the_mixture_of_the_last_predictions(llada_checkpoint, top_k, weight, renormalize):
    llm = dmax(llada_checkpoint, buffer_size=2, add_block_threshold=0.25, semi_complete_threshold=0.5,
               token_merge_top_k=top_k, token_merge_weight=weight, token_merge_renormalize=renormalize)
    rec = StepRecorder(llm)
    table = llm.model.embed_tokens.weight
    mask_id = llm.config.mask_token_id
    llm.add_request(PROMPTS[2], SamplingParams(max_tokens=16, ignore_eos=True))
    latest = {}  # position -> (top-k ids, their probabilities) of its last prediction
    soft_rows = 0
    while llm.has_unfinished_requests():
        plan = rec.step()
        fed = rec.embeds[-1]
        for row, position in enumerate(range(plan.start, plan.end)):
            token = int(plan.token_ids[row])
            if position >= plan.committed_end and token != mask_id and position in latest:
                soft_rows += 1
                expected = hand_mixture(table, token, *latest[position], mask_id, weight, renormalize)
            else:
                expected = table[token]
            torch.testing.assert_close(fed[row], expected, rtol=1e-6, atol=1e-6)
        probs = rec.logits[-1].softmax(-1)
        at = 0
        for block in plan.blocks:
            for position in range(block.start, block.end):
                top = probs[at].topk(top_k)
                latest[position] = (top.indices.tolist(), top.values.tolist())
                at += 1
    assert soft_rows > 20


def test_an_edited_block_never_commits_before_it_is_stable(llada_checkpoint):
    threshold = 0.6
    llm = dmax(llada_checkpoint, edit_threshold=threshold, buffer_size=2, add_block_threshold=0.25,
               semi_complete_threshold=0.5)
    rec = StepRecorder(llm)
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))
    req = llm.requests[rid]
    mask_id, bs = llm.config.mask_token_id, llm.config.block_size
    edits = held_back = commits = capped = 0
    steps_full = {}  # first block's start -> steps it ended full
    while llm.has_unfinished_requests():
        committed_before = req.num_committed_blocks
        plan = rec.step()
        top1 = rec.logits[-1].softmax(-1).max(-1).values
        at = 0
        for block in plan.blocks:
            before = plan.token_ids[block.start - plan.start:block.end - plan.start]
            after = req.tokens[block.start:block.end]
            edits += int(((before != mask_id) & (after != before)).sum())
            n = block.end - block.start
            settled = bool((top1[at:at + n] >= threshold).all()) or bool((after == before).all())
            full = not bool((after == mask_id).any())
            if block.is_first and full:
                steps_full[block.start] = steps_full.get(block.start, 0) + 1
                if req.num_committed_blocks > committed_before:
                    commits += 1
                    # Stable, or held back for block_size steps already (decoding must end).
                    assert settled or steps_full[block.start] > bs, (block, before, after)
                    capped += not settled
                else:
                    held_back += 1
            at += n
    assert commits == 4 and edits > 0 and held_back > capped


def test_outputs_do_not_depend_on_batching_or_preemption(llada_checkpoint):
    extra = dict(buffer_size=2, add_block_threshold=0.25, semi_complete_threshold=0.5, token_merge_top_k=2)
    alone = [s.token_ids for s in run_one_at_a_time(dmax(llada_checkpoint, **extra), PROMPTS, PARAMS)]
    assert tokens(dmax(llada_checkpoint, **extra)) == alone
    assert tokens(dmax(llada_checkpoint, max_num_batched_tokens=24, **extra)) == alone  # prefills split into chunks
    small = dmax(llada_checkpoint, num_kv_pages=20, **extra)  # the largest request needs 17
    assert tokens(small) == alone
    assert small.metrics().num_preemptions > 0


def test_padded_graph_layout_gives_the_same_tokens(llada_checkpoint):
    # The CUDA-graph path's inputs, soft buffers included, run eagerly on the CPU.
    extra = dict(buffer_size=2, add_block_threshold=0.25, semi_complete_threshold=0.5, token_merge_top_k=2)
    eager = tokens(dmax(llada_checkpoint, **extra))
    llm = dmax(llada_checkpoint, **extra)
    runner = llm.runner
    runner.padded_forward = PaddedForward(llm.model, runner.kv_cache, llm.config, llm.device, runner.token_merge)
    assert tokens(llm) == eager


def test_request_edit_threshold_overrides_the_engine_setting(llada_checkpoint):
    off = tokens(dmax(llada_checkpoint, edit_threshold=0.0))
    params = SamplingParams(max_tokens=14, ignore_eos=True, edit_threshold=0.0)
    assert tokens(dmax(llada_checkpoint, edit_threshold=0.8), params=params) == off


@pytest.mark.parametrize("overrides,message", [
    (dict(token_merge_mode="soft"), "'token_merge_mode' must be one of"),
    (dict(token_merge_top_k=0), "'token_merge_top_k' must be an integer >= 1"),
    (dict(token_merge_weight=1.5), "'token_merge_weight' must be a number in [0, 1]"),
    (dict(edit_threshold=-0.1), "'edit_threshold' must be a number in [0, 1]"),
    (dict(token_merge_renormalize="yes"), "'token_merge_renormalize' must be true or false"),
    (dict(buffer_size=65), "'buffer_size' must be <= 64"),
])
def test_config_errors_name_the_field(llada_checkpoint, overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Diffulex(llada_checkpoint, **{**dict(decoding_strategy="dmax", device="cpu"), **overrides})


def test_request_errors_name_the_parameter(llada_checkpoint):
    with pytest.raises(ValueError, match=r"'edit_threshold' must be a number in \[0, 1\] or null"):
        SamplingParams(edit_threshold=1.5)
    llm = tiny_engine(llada_checkpoint, decoding_strategy="multi_bd")
    with pytest.raises(ValueError, match="'edit_threshold' applies to decoding_strategy 'dmax' only, not 'multi_bd'"):
        llm.add_request("hi", SamplingParams(max_tokens=8, edit_threshold=0.5))
    assert not llm.has_unfinished_requests()


def test_config_pbtxt_settings_reach_the_strategy(llada_checkpoint, tmp_path):
    from diffulex_backend.serving.engine_settings import engine_settings

    parameters = {"model": llada_checkpoint, "decoding_strategy": "dmax", "block_size": "4", "page_size": "4",
                  "max_model_len": "96", "max_num_batched_tokens": "128", "dtype": "float64", "device": "cpu",
                  "accept_threshold": "0.3", "token_merge_mode": "dmax_topk", "token_merge_top_k": "2",
                  "token_merge_renormalize": "false", "token_merge_weight": "0.5", "edit_threshold": "0.7"}
    llm = Diffulex(**engine_settings({k: {"string_value": v} for k, v in parameters.items()}, tmp_path))
    same = dmax(llada_checkpoint, token_merge_top_k=2, token_merge_renormalize=False, token_merge_weight=0.5,
                edit_threshold=0.7)
    assert tokens(llm) == tokens(same)
    assert tokens(llm) != tokens(dmax(llada_checkpoint))
