"""The MoE layer's routing rules and expert math, on hand-made scores, and the MoE fields of ModelArch."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from diffulex_backend.layers.moe import experts_reference, select_experts
from diffulex_backend.arch import ModelArch, RouterScore
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES

TINY = ModelArch(
    model_name="llada2", hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
    vocab_size=32, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
    mask_token_id=None, eos_token_ids=(), shifted=False, block_size=None, qk_norm=True, partial_rotary_factor=0.5,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, num_shared_experts=1, dense_layers=(0,),
    num_expert_groups=4, topk_groups=2, router_score=RouterScore.SIGMOID, router_bias=True,
    routed_scaling_factor=2.5,
)


def sigmoid_logits(scores: list[list[float]]) -> torch.Tensor:
    """Router logits whose sigmoid is `scores`, in float64 so the scores come back exactly enough."""
    return torch.logit(torch.tensor(scores, dtype=torch.float64))


def test_expert_bias_changes_the_selection_but_not_the_weights():
    # Groups of two: (0, 1) (2, 3) (4, 5) (6, 7). Unbiased, experts 0 and 1 win; a bias on expert 3 makes group
    # (2, 3) and then expert 3 the best, and its weight is still computed from its unbiased score 0.2.
    scores = [[0.9, 0.8, 0.1, 0.2, 0.3, 0.3, 0.05, 0.05]]
    ids, weights = select_experts(sigmoid_logits(scores), None, TINY)
    assert ids.tolist() == [[0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    ids, weights = select_experts(sigmoid_logits(scores), bias, TINY)
    assert ids.tolist() == [[3, 0]]
    assert weights[0].tolist() == pytest.approx([2.5 * 0.2 / 1.1, 2.5 * 0.9 / 1.1], rel=1e-12)


def test_groups_are_scored_by_their_two_best_experts_and_only_kept_groups_compete():
    # Expert 6 has the best single score, but its group (6, 7) sums to 0.95 + 0.0 and is not among the two best
    # groups, (0, 1) with 1.2 and (2, 3) with 1.1; the chosen experts come from those.
    scores = [[0.6, 0.6, 0.55, 0.55, 0.4, 0.4, 0.95, 0.001]]
    ids, _ = select_experts(sigmoid_logits(scores), None, TINY)
    assert 6 not in ids.tolist()[0]
    assert ids.tolist() == [[0, 1]]


def test_all_choices_can_land_in_one_group():
    arch = dataclasses.replace(TINY, num_experts_per_tok=4, num_experts=16, num_expert_groups=4, topk_groups=2)
    scores = [[0.9, 0.89, 0.88, 0.87] + [0.1] * 4 + [0.5, 0.05, 0.05, 0.05] + [0.05] * 4]
    ids, weights = select_experts(sigmoid_logits(scores), None, arch)
    assert ids.tolist() == [[0, 1, 2, 3]]
    assert weights.sum().item() == pytest.approx(2.5)


def test_equal_scores_go_to_the_lower_expert_and_group():
    scores = [[0.5] * 8]
    ids, weights = select_experts(sigmoid_logits(scores), None, TINY)
    assert ids.tolist() == [[0, 1]]
    assert weights[0].tolist() == pytest.approx([1.25, 1.25])
    softmax_arch = dataclasses.replace(TINY, router_score=RouterScore.SOFTMAX, num_expert_groups=1, topk_groups=1,
                                       routed_scaling_factor=1.0, router_bias=False)
    ids, _ = select_experts(torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]), None, softmax_arch)
    assert ids.tolist() == [[1, 2]]


def test_softmax_router_without_renormalisation_keeps_the_softmax_probabilities():
    arch = dataclasses.replace(TINY, router_score=RouterScore.SOFTMAX, num_expert_groups=1, topk_groups=1,
                               routed_scaling_factor=1.0, norm_topk_prob=False, router_bias=False)
    logits = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids, weights = select_experts(logits, None, arch)
    probs = logits.softmax(-1)
    assert torch.equal(ids, probs.topk(2).indices)
    assert torch.allclose(weights, probs.topk(2).values)


def test_experts_reference_is_the_weighted_sum_of_each_chosen_expert_and_skips_idle_experts():
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts, k = 5, 8, 4, 6, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.float64, generator=gen)
    w_down = torch.randn(experts, hidden, inter, dtype=torch.float64, generator=gen)
    ids = torch.tensor([[0, 3], [3, 0], [5, 3], [0, 5], [3, 5]])  # experts 1, 2 and 4 get no token
    weights = torch.rand(tokens, k, dtype=torch.float64, generator=gen)
    out = experts_reference(x, w_gate_up, w_down, ids, weights)
    for t in range(tokens):
        want = sum(weights[t, j] * w_down[e] @ (F.silu(w_gate_up[e, :inter] @ x[t]) * (w_gate_up[e, inter:] @ x[t]))
                   for j, e in enumerate(ids[t].tolist()))
        assert torch.allclose(out[t], want, rtol=1e-12, atol=1e-12)


def test_moe_arch_rejects_inconsistent_routing():
    with pytest.raises(ValueError, match=r"num_experts \(10\) must be a multiple of num_expert_groups \(4\)"):
        dataclasses.replace(TINY, num_experts=10)
    with pytest.raises(ValueError, match=r"topk_groups \(5\) exceeds num_expert_groups \(4\)"):
        dataclasses.replace(TINY, topk_groups=5)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds the 4 experts of the 2 kept groups"):
        dataclasses.replace(TINY, num_experts_per_tok=5)
    with pytest.raises(ValueError, match=r"dense_layers \(3,\) must name layers in \[0, 3\)"):
        dataclasses.replace(TINY, dense_layers=(3,))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.3"):
        dataclasses.replace(TINY, partial_rotary_factor=0.3)


def test_active_params_and_expert_sizes_of_llada2_mini():
    from diffulex_backend.models.llada2 import LLaDA2Model
    from diffulex_backend.testing.checkpoint import random_config

    spec = dict(RELEASED_SHAPES["llada2-mini"])
    arch = LLaDA2Model.parse_config(random_config(spec.pop("model_name"), **spec), "config.json")
    assert arch.num_params() == 16_255_643_392  # "16 B"
    assert arch.num_active_params() == 1_432_973_056  # "1.4 B activated"
    assert arch.num_moe_layers == 19 and arch.rotary_dim == 64
    assert arch.expert_params == 3 * 2048 * 512  # gate, up and down of one routed expert
    assert arch.expected_touched_experts(1) == pytest.approx(8)
    assert arch.expected_touched_experts(32) == pytest.approx(163.4, abs=0.1)  # "about 160 of 256"
    assert arch.expected_touched_experts(4096) == pytest.approx(256)
