"""The routing kernel picks the same experts, in the same order, as the torch `select_experts` it replaces, with the
same weights: softmax and sigmoid scores, with and without a selection bias, with and without expert groups, on
ties, with every choice in one group, without renormalisation, and through the MoE layer's `fused` switch."""
from __future__ import annotations

import pytest
import torch
from diffulex_kernels import route_experts
from diffulex_kernels.moe_routing import SIGMOID, SOFTMAX
from kernel_cases import DEVICE, FULL_SHAPES, generator

from diffulex_backend.layers.moe import select_experts
from diffulex_backend.arch import ModelArch, RouterScore

# (experts, groups, groups kept, top k): no groups; 16 experts in 4 groups keeping 2; 64 in 8 keeping 4; and at full
# shapes LLaDA2-mini's 256 in 8 keeping 4 and Qwen3-30B-A3B's 128 without groups.
ROUTINGS = [(8, 1, 1, 2), (16, 4, 2, 4), (64, 8, 4, 8)]
if FULL_SHAPES:
    ROUTINGS += [(256, 8, 4, 8), (128, 1, 1, 8)]
TOKENS = [1, 7, 40]
WEIGHT_TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32 sums in another order


def router_arch(experts: int, groups: int, kept: int, top_k: int, score: RouterScore, bias: bool,
                renormalize: bool = True, scaling: float = 1.0) -> ModelArch:
    return ModelArch(
        model_name="llada2", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
        intermediate_size=64, vocab_size=64, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64,
        tie_word_embeddings=False, mask_token_id=None, eos_token_ids=(), shifted=False, block_size=None,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32, num_expert_groups=groups,
        topk_groups=kept, router_score=score, router_bias=bias, norm_topk_prob=renormalize,
        routed_scaling_factor=scaling,
    )


def kernel_routing(logits: torch.Tensor, bias: torch.Tensor | None, arch: ModelArch):
    return route_experts(
        logits, bias, top_k=arch.num_experts_per_tok, num_groups=arch.num_expert_groups, topk_groups=arch.topk_groups,
        score=SIGMOID if arch.router_score is RouterScore.SIGMOID else SOFTMAX, renormalize=arch.norm_topk_prob,
        scaling=arch.routed_scaling_factor,
    )


def assert_same_routing(logits: torch.Tensor, bias: torch.Tensor | None, arch: ModelArch) -> torch.Tensor:
    ids, weights = kernel_routing(logits, bias, arch)
    expected_ids, expected_weights = select_experts(logits, bias, arch)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], arch.num_experts_per_tok)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **WEIGHT_TOL)
    return ids


def random_bias(experts: int, gen: torch.Generator) -> torch.Tensor:
    # Large enough against the scores (softmax's are ~1/E) to move the selection.
    return torch.randn(experts, generator=gen, device=DEVICE) * 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("score", list(RouterScore), ids=lambda s: s.value)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_kernel_picks_the_experts_and_weights_of_select_experts(routing, tokens, score, with_bias, dtype):
    experts, groups, kept, top_k = routing
    gen = generator(tokens * 131 + experts + groups + (7 if with_bias else 0))
    logits = (torch.randn(tokens, experts, generator=gen, device=DEVICE) * 2).to(dtype)
    bias = random_bias(experts, gen) if with_bias else None
    assert_same_routing(logits, bias, router_arch(experts, groups, kept, top_k, score, with_bias))


@pytest.mark.parametrize("score", list(RouterScore), ids=lambda s: s.value)
def test_equal_logits_go_to_the_lowest_groups_and_experts(score):
    # Every score equal: the best groups are the first ones and the experts the first of those, best first.
    arch = router_arch(16, 4, 2, 4, score, bias=False)
    ids = assert_same_routing(torch.zeros(3, 16, device=DEVICE), None, arch)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    # Two groups tied for best: the lower one first; within it, experts tied by pairs.
    logits = torch.tensor([[0, 0, 0, 0, 2, 2, 1, 1, 0, 0, 0, 0, 2, 2, 1, 1]], dtype=torch.float32, device=DEVICE)
    arch = router_arch(16, 4, 1, 3, score, bias=False)
    assert assert_same_routing(logits, None, arch).tolist() == [[4, 5, 6]]


def test_ties_among_random_bf16_logits():
    # Few distinct values: most experts tie with another.
    gen = generator(21)
    logits = torch.randint(-2, 3, (40, 64), generator=gen, device=DEVICE).to(torch.bfloat16)
    for score in RouterScore:
        assert_same_routing(logits, None, router_arch(64, 8, 4, 8, score, bias=False))
        assert_same_routing(logits, None, router_arch(64, 1, 1, 8, score, bias=False))


def test_every_choice_in_one_group():
    # The bias lifts group 2 far above the others and only one group is kept: all K choices are its four experts.
    gen = generator(22)
    logits = torch.randn(9, 16, generator=gen, device=DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    bias[8:12] = 1.0
    ids = assert_same_routing(logits, bias, router_arch(16, 4, 1, 4, RouterScore.SIGMOID, bias=True))
    assert (ids.sort(dim=1).values == torch.arange(8, 12, device=DEVICE)).all()


@pytest.mark.parametrize("score", list(RouterScore), ids=lambda s: s.value)
def test_weights_without_renormalisation_are_the_scaled_scores(score):
    gen = generator(23)
    logits = torch.randn(5, 64, generator=gen, device=DEVICE)
    bias = random_bias(64, gen)
    arch = router_arch(64, 8, 4, 6, score, bias=True, renormalize=False, scaling=2.5)
    ids = assert_same_routing(logits, bias, arch)
    scores = logits.sigmoid() if score is RouterScore.SIGMOID else logits.softmax(-1)
    torch.testing.assert_close(kernel_routing(logits, bias, arch)[1], scores.gather(1, ids) * 2.5, **WEIGHT_TOL)


def test_strided_logits_and_no_tokens():
    gen = generator(24)
    wide = torch.randn(7, 40, generator=gen, device=DEVICE)
    arch = router_arch(16, 4, 2, 4, RouterScore.SOFTMAX, bias=False)
    assert_same_routing(wide[:, 3:19], None, arch)  # rows 40 apart
    ids, weights = kernel_routing(torch.zeros(0, 16, device=DEVICE), None, arch)
    assert ids.shape == weights.shape == (0, 4)


def test_the_fused_switch_of_select_experts_runs_the_kernel():
    gen = generator(25)
    logits = torch.randn(6, 64, generator=gen, device=DEVICE)
    bias = random_bias(64, gen)
    arch = router_arch(64, 8, 4, 8, RouterScore.SIGMOID, bias=True, scaling=2.5)
    ids, weights = select_experts(logits, bias, arch, fused=True)
    expected_ids, expected_weights = select_experts(logits, bias, arch)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **WEIGHT_TOL)


@pytest.mark.parametrize("num_shared", [1, 2])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
def test_shared_experts_follow_the_routed_choices_at_weight_one(fused, num_shared):
    """With num_shared, each token's routed choices (unchanged, scaled and renormalised as before) are followed by
    experts E, E + 1, ... at weight 1, which the scaling factor leaves alone: the fused-MoE kernel then runs the
    shared experts among the routed ones."""
    gen = generator(27)
    logits = torch.randn(7, 64, generator=gen, device=DEVICE)
    bias = random_bias(64, gen)
    arch = router_arch(64, 8, 4, 6, RouterScore.SIGMOID, bias=True, scaling=2.5)
    routed_ids, routed_weights = select_experts(logits, bias, arch, fused=fused)
    ids, weights = select_experts(logits, bias, arch, fused=fused, num_shared=num_shared)
    assert ids.shape == weights.shape == (7, 6 + num_shared)
    assert torch.equal(ids[:, :6], routed_ids) and torch.equal(weights[:, :6], routed_weights)
    assert torch.equal(ids[:, 6:], torch.arange(64, 64 + num_shared, device=DEVICE).expand(7, num_shared))
    assert torch.equal(weights[:, 6:], torch.ones(7, num_shared, device=DEVICE))


def test_a_negative_count_of_shared_experts_is_refused():
    with pytest.raises(ValueError, match="num_shared must be >= 0, got -1"):
        route_experts(torch.zeros(3, 16, device=DEVICE), None, top_k=4, num_groups=4, topk_groups=2, score=SOFTMAX,
                      renormalize=True, scaling=1.0, num_shared=-1)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="groups"):
        route_experts(torch.zeros(1, 10, device=DEVICE), None, top_k=2, num_groups=4, topk_groups=2, score=SOFTMAX,
                      renormalize=True, scaling=1.0)


@pytest.mark.parametrize("score", [SOFTMAX, SIGMOID], ids=["softmax", "sigmoid"])
@pytest.mark.parametrize("routing", [(8, 1, 1, 2), (16, 4, 2, 4)], ids=str)
def test_rows_of_nan_or_infinite_logits_still_pick_experts_that_exist(routing, score):
    """A CUDA graph's padding rows hold whatever was in memory, and an overflowed input gives infinite logits: the
    expert kernels take the ids as addresses, so every row picks K distinct experts in range, whatever its
    logits, and the finite rows beside it route as they would alone."""
    experts, groups, kept, top_k = routing
    arch = router_arch(experts, groups, kept, top_k, RouterScore.SIGMOID if score == SIGMOID else RouterScore.SOFTMAX,
                       bias=False)
    logits = torch.randn(6, experts, generator=generator(3), device=DEVICE)
    logits[1] = float("nan")
    logits[2, ::3] = float("nan")
    logits[3] = float("inf")
    logits[4, 0] = float("-inf")
    logits[5, 1] = float("inf")
    ids, _ = kernel_routing(logits, None, arch)
    assert bool(((ids >= 0) & (ids < experts)).all()), ids
    assert all(len(set(row.tolist())) == top_k for row in ids)
    finite = [0, 4]
    assert torch.equal(ids[finite], kernel_routing(logits[finite], None, arch)[0])
    assert torch.equal(ids[finite], select_experts(logits[finite], None, arch)[0])


@pytest.mark.parametrize("routing", [(8, 1, 1, 2), (64, 8, 4, 8)], ids=str)
def test_a_split_product_s_partial_sums_route_as_their_sum(routing):
    """The fused forward hands the router's split-K partial sums [S, T, E] over: the kernel and select_experts add
    them up in order, and route as the summed logits. Multiples of 1/64 of a few units sum exactly in any order,
    so the three must agree bit for bit."""
    experts, groups, kept, top_k = routing
    arch = router_arch(experts, groups, kept, top_k, RouterScore.SIGMOID, bias=True)
    gen = generator(4)
    partials = torch.randint(-256, 256, (4, 7, experts), generator=gen, device=DEVICE).float() / 64
    bias = torch.randn(experts, generator=gen, device=DEVICE)
    ids, weights = kernel_routing(partials, bias, arch)
    summed_ids, summed_weights = kernel_routing(partials.sum(0), bias, arch)
    assert torch.equal(ids, summed_ids) and torch.equal(weights, summed_weights)
    torch_ids, torch_weights = select_experts(partials, bias, arch)
    assert torch.equal(ids, torch_ids)
    torch.testing.assert_close(weights, torch_weights, **WEIGHT_TOL)
    # A strided view of the partials (every other token) routes as those tokens do.
    assert torch.equal(kernel_routing(partials[:, ::2], bias, arch)[0], ids[::2])
