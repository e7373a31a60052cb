"""The fused MoE equals its torch reference and a float64 loop over every (token, choice), under ragged expert loads,
experts that get no token, every choice in one expert group, and a single token; the routing step sorts and pads the
pairs as the kernels assume; and the result is the same bits run after run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffulex_kernels import fused_moe
from diffulex_kernels.moe import (
    GELU_TANH, SILU, MoeLaunch, SharedExperts, fused_moe_reference, max_tiles, plan_moe_launch, route_to_tiles,
)
from diffulex_backend.layers.moe import with_shared_choices
from kernel_cases import DEVICE, FULL_SHAPES, REL_TOL, generator, randn, relative_error

# (experts, hidden, intermediate): LLaDA2-mini's and Qwen3-30B-A3B's (SDAR-30B-A3B's) expert shapes, or small ones
# whose intermediate size leaves a ragged column tile.
EXPERT_SHAPES = [(256, 2048, 512), (128, 2048, 768)] if FULL_SHAPES else [(8, 64, 32), (8, 64, 48)]
TOKENS = [1, 32, 256] if FULL_SHAPES else [1, 7, 40]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def route(tokens: int, num_experts: int, top_k: int, gen: torch.Generator, allowed: list[int] | None = None):
    """Distinct top-k experts per token by random scores (only among `allowed` if given), and softmax weights."""
    scores = torch.randn(tokens, num_experts, generator=gen, device=DEVICE)
    if allowed is not None:
        barred = torch.ones(num_experts, dtype=torch.bool, device=DEVICE)
        barred[allowed] = False
        scores[:, barred] = float("-inf")
    values, ids = scores.topk(top_k, dim=1)
    return ids, torch.softmax(values, dim=1)


def moe_inputs(tokens: int, shape: tuple[int, int, int], dtype: torch.dtype, gen: torch.Generator):
    num_experts, hidden, inter = shape
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    # Scaled so that gate, up and the output stay near 1, well inside fp16's range.
    w_gate_up = (randn(num_experts, 2 * inter, hidden, dtype=torch.float32, gen=gen) * hidden**-0.5).to(dtype)
    w_down = (randn(num_experts, hidden, inter, dtype=torch.float32, gen=gen) * inter**-0.5).to(dtype)
    return x, w_gate_up, w_down


def per_token_loop(x, w_gate_up, w_down, topk_ids, topk_weights, activation=SILU) -> torch.Tensor:
    """The contract, one (token, choice) at a time, in float64."""
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w_gate_up[e].double() @ x[t].double()
            gate = F.gelu(gate_up[:inter], approximate="tanh") if activation == GELU_TANH else F.silu(gate_up[:inter])
            act = gate * gate_up[inter:]
            out[t] += float(topk_weights[t, k]) * (w_down[e].double() @ act)
    return out


def check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights, launch=None,
                                   activation=SILU) -> torch.Tensor:
    out = fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, launch=launch, activation=activation)
    assert out.shape == x.shape and out.dtype == x.dtype
    reference = fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights, activation=activation)
    assert reference.shape == x.shape and reference.dtype == x.dtype
    tolerance = REL_TOL[x.dtype]
    assert relative_error(out, reference) < tolerance
    assert relative_error(out, per_token_loop(x, w_gate_up, w_down, topk_ids, topk_weights, activation)) < tolerance
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=str)
def test_routed_tokens_match_both_references(shape, tokens, top_k, dtype):
    gen = generator(tokens * 31 + top_k + shape[2])
    x, w_gate_up, w_down = moe_inputs(tokens, shape, dtype, gen)
    topk_ids, topk_weights = route(tokens, shape[0], top_k, gen)
    check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_a_gelu_tanh_gate_matches_both_references(tokens, dtype):
    """DiffusionGemma's experts: gelu with torch's tanh approximation in place of SiLU, including gates large enough
    that tanh saturates (where exp overflows in float32). Against SiLU's result too: the activation was applied."""
    gen = generator(tokens * 7 + 3)
    x, w_gate_up, w_down = moe_inputs(tokens, EXPERT_SHAPES[0], dtype, gen)
    topk_ids, topk_weights = route(tokens, EXPERT_SHAPES[0][0], 2, gen)
    out = check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights, activation=GELU_TANH)
    # SiLU's result is several tolerances away (0.14 at one token of the full shapes on a GPU, in bf16).
    assert relative_error(out, fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights)) > 3 * REL_TOL[dtype]
    w_gate_up[:, :4] *= 64  # the first gate columns reach |gate| of tens
    check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights, activation=GELU_TANH)


def test_an_activation_other_than_silu_or_gelu_tanh_is_refused():
    gen = generator(17)
    x, w_gate_up, w_down = moe_inputs(3, EXPERT_SHAPES[0], torch.float32, gen)
    topk_ids, topk_weights = route(3, EXPERT_SHAPES[0][0], 2, gen)
    with pytest.raises(ValueError, match="activation must be SILU"):
        fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, activation=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_experts_that_get_no_token_and_ragged_loads(dtype):
    # Three of eight experts share every token: runs of 40, 40 and 40 pairs (three tiles each at 16 rows,
    # the last partly padding), and five experts get nothing.
    shape = EXPERT_SHAPES[0]
    gen = generator(11)
    x, w_gate_up, w_down = moe_inputs(40, shape, dtype, gen)
    topk_ids, topk_weights = route(40, shape[0], 3, gen, allowed=[1, 4, 6])
    check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights)


def test_every_choice_in_one_expert_group():
    # Group-limited routing with groups of four experts: all four choices of every token land in group 1.
    shape = EXPERT_SHAPES[0]
    num_experts = shape[0]
    group = list(range(num_experts // 2, num_experts // 2 + 4))
    gen = generator(12)
    x, w_gate_up, w_down = moe_inputs(9, shape, torch.bfloat16, gen)
    topk_ids, topk_weights = route(9, num_experts, 4, gen, allowed=group)
    assert set(topk_ids.flatten().tolist()) <= set(group)
    check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights)


def test_single_token_with_one_choice():
    gen = generator(13)
    x, w_gate_up, w_down = moe_inputs(1, EXPERT_SHAPES[0], torch.bfloat16, gen)
    topk_ids, topk_weights = route(1, EXPERT_SHAPES[0][0], 1, gen)
    check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights)


@pytest.mark.parametrize("launch", [MoeLaunch(32, 32, 32, 4, 2), MoeLaunch(16, 16, 16, 2, 2)], ids=str)
def test_other_tiles_give_the_same_products(launch):
    # Tiles that divide H and I evenly (the unmasked K loop) and split it into several steps.
    gen = generator(14)
    x, w_gate_up, w_down = moe_inputs(40, EXPERT_SHAPES[0], torch.bfloat16, gen)
    topk_ids, topk_weights = route(40, EXPERT_SHAPES[0][0], 4, gen)
    check_against_both_references(x, w_gate_up, w_down, topk_ids, topk_weights, launch=launch)


def test_same_bits_run_after_run():
    gen = generator(15)
    x, w_gate_up, w_down = moe_inputs(40, EXPERT_SHAPES[0], torch.bfloat16, gen)
    topk_ids, topk_weights = route(40, EXPERT_SHAPES[0][0], 4, gen)
    first = fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights)
    assert torch.equal(fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights), first)


@pytest.mark.parametrize("partials", [1, 3])
def test_shared_partial_sums_are_added_to_each_token_before_its_one_rounding(partials):
    """A shared expert's split-K partial sums [S, T, H] go into the combine: the result is the routed sum plus
    theirs in float32, rounded once to the activations' dtype."""
    gen = generator(12)
    x, w_gate_up, w_down = moe_inputs(7, EXPERT_SHAPES[0], torch.float32, gen)
    topk_ids, topk_weights = route(7, EXPERT_SHAPES[0][0], 2, gen)
    shared = randn(partials, 7, x.shape[1], dtype=torch.float32, gen=gen)
    alone = fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights)
    out = fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, shared=shared)
    torch.testing.assert_close(out, alone + shared.sum(0), rtol=1e-6, atol=1e-6)
    assert not torch.equal(out, alone)
    bf16 = fused_moe(x.bfloat16(), w_gate_up.bfloat16(), w_down.bfloat16(), topk_ids, topk_weights, shared=shared)
    want = fused_moe(x.bfloat16(), w_gate_up.bfloat16(), w_down.bfloat16(), topk_ids, topk_weights,
                     shared=torch.zeros_like(shared)).float() + shared.sum(0)
    assert bf16.dtype == torch.bfloat16 and relative_error(bf16, want) < 2**-8
    with pytest.raises(ValueError, match=r"shared partial sums must be \[S, 7, 64\]"):
        fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, shared=shared[:, :6])


def dense_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) in float64: the shared experts as the dense MLP they are."""
    gate, up = (x.double() @ w_gate_up.double().T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.double().T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_shared_experts_among_the_routed_ones_add_their_dense_mlp(tokens, count, dtype):
    """Shared experts run as experts E, E + 1, ... of the same launches: each token's output is its routed sum plus
    the shared MLP of count * I columns, as a dense MLP gives it, expert s reading columns s * I to (s + 1) * I."""
    gen = generator(17)
    shape = EXPERT_SHAPES[1]  # a ragged column tile
    num_experts, hidden, inter = shape
    x, w_gate_up, w_down = moe_inputs(tokens, shape, dtype, gen)
    shared = SharedExperts(
        (randn(2 * count * inter, hidden, dtype=torch.float32, gen=gen) * hidden**-0.5).to(dtype),
        (randn(hidden, count * inter, dtype=torch.float32, gen=gen) * (count * inter)**-0.5).to(dtype))
    topk_ids, topk_weights = route(tokens, num_experts, 2, gen)
    ids, weights = with_shared_choices(topk_ids, topk_weights, num_experts, count)
    out = fused_moe(x, w_gate_up, w_down, ids, weights, shared_experts=shared)
    want = per_token_loop(x, w_gate_up, w_down, topk_ids, topk_weights) + dense_mlp(x, shared.w_gate_up, shared.w_down)
    assert out.dtype == dtype and relative_error(out, want) < REL_TOL[dtype]
    reference = fused_moe_reference(x, w_gate_up, w_down, ids, weights, shared_experts=shared)
    assert relative_error(out, reference) < REL_TOL[dtype]
    # Without them the same launches give the routed sum alone: the shared rows are what differs.
    assert relative_error(out, want - dense_mlp(x, shared.w_gate_up, shared.w_down)) > 3 * REL_TOL[dtype]


def test_shared_experts_that_are_not_whole_experts_of_the_stacks_are_refused():
    gen = generator(18)
    x, w_gate_up, w_down = moe_inputs(4, EXPERT_SHAPES[0], torch.float32, gen)
    num_experts, hidden, inter = EXPERT_SHAPES[0]
    ids, weights = with_shared_choices(*route(4, num_experts, 2, gen), num_experts, 1)
    cases = {
        "not a multiple of the experts' columns": SharedExperts(w_gate_up[0, :inter + 2],
                                                                w_down[0][:, :inter // 2 + 1]),
        "another dtype": SharedExperts(w_gate_up[0].double(), w_down[0].double()),
        "gate_up of other columns than down": SharedExperts(w_gate_up[0], torch.cat([w_down[0], w_down[1]], 1)),
    }
    for why, shared in cases.items():
        with pytest.raises(ValueError, match="are not whole experts of the stacks"):
            fused_moe(x, w_gate_up, w_down, ids, weights, shared_experts=shared)
    with pytest.raises(ValueError, match=r"K must exceed 1; got \(4, 1\)"):
        fused_moe(x, w_gate_up, w_down, ids[:, -1:], weights[:, -1:],
                  shared_experts=SharedExperts(w_gate_up[0], w_down[0]))
    with pytest.raises(ValueError, match=f"expert {num_experts} is past the stacks' {num_experts} experts, and no "
                                         "shared experts were given"):
        fused_moe_reference(x, w_gate_up, w_down, ids, weights)
    with pytest.raises(ValueError, match="shared experts take scales exactly when the stacks do"):
        fused_moe(x, w_gate_up, w_down, ids, weights,
                  shared_experts=SharedExperts(w_gate_up[0], w_down[0], torch.ones(2 * inter, 1, device=DEVICE),
                                              torch.ones(hidden, 1, device=DEVICE)))


def test_no_tokens_give_an_empty_output():
    gen = generator(16)
    x, w_gate_up, w_down = moe_inputs(0, EXPERT_SHAPES[0], torch.bfloat16, gen)
    topk_ids = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    out = fused_moe(x, w_gate_up, w_down, topk_ids, torch.zeros(0, 2, device=DEVICE))
    assert out.shape == (0, EXPERT_SHAPES[0][1])


def test_routing_groups_the_pairs_by_expert_in_padded_tiles():
    num_experts, block_m = 6, 4
    topk_ids = torch.tensor([[5, 0], [0, 2], [5, 0], [2, 0], [0, 5]], device=DEVICE)  # expert 0: 5 pairs, 2: 2, 5: 3
    routed = route_to_tiles(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    assert routed.max_tiles == max_tiles(num_pairs, num_experts, block_m) == (10 + 6 * 3) // 4
    pad = num_pairs
    # Expert 0 in two tiles, then 2, then 5; each run in pair order; the experts with no token get no tile.
    assert routed.tile_experts.tolist() == [0, 0, 2, 5] + [num_experts] * (routed.max_tiles - 4)
    assert routed.pair_ids[:16].tolist() == [1, 2, 5, 7, 8, pad, pad, pad, 3, 6, pad, pad, 0, 4, 9, pad]
    assert (routed.pair_ids[16:] == pad).all()


def test_no_routing_needs_more_tiles_than_the_bound():
    # Every pair in its own expert pads the most: one tile each.
    topk_ids = torch.arange(12, device=DEVICE).view(6, 2)
    routed = route_to_tiles(topk_ids, 12, 16)
    assert routed.max_tiles == 12 and (routed.tile_experts == torch.arange(12, device=DEVICE)).all()


def test_routing_of_many_chunks_equals_a_stable_sort_by_expert():
    # More pairs than one step of the planning kernel takes (several chunk steps, several tile steps), six experts.
    num_experts, block_m = 6, 16
    gen = generator(17)
    topk_ids, _ = route(700, num_experts, 4, gen)
    routed = route_to_tiles(topk_ids, num_experts, block_m)
    flat = topk_ids.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    expected_pairs, expected_experts = [], []
    for expert, count in enumerate(counts):
        tiles = -(-count // block_m)
        run = order[flat[order] == expert].tolist()
        expected_pairs += run + [flat.numel()] * (tiles * block_m - count)
        expected_experts += [expert] * tiles
    num_real = len(expected_experts)
    assert routed.max_tiles > 64 and routed.tile_experts[:num_real].tolist() == expected_experts
    assert (routed.tile_experts[num_real:] == num_experts).all()
    assert routed.pair_ids[:num_real * block_m].tolist() == expected_pairs
    assert (routed.pair_ids[num_real * block_m:] == flat.numel()).all()


def test_decode_tiles_are_16_rows_and_grow_with_the_pairs_per_expert():
    assert plan_moe_launch(32 * 8, 256).block_m == 16  # one block of 32 tokens: ~1.6 pairs per touched expert
    assert plan_moe_launch(256 * 8, 128).block_m == 32
    assert plan_moe_launch(1024 * 8, 256).block_m == 64
    assert plan_moe_launch(2048 * 8, 128).block_m == 128


def test_32_bit_weights_take_half_the_tile_depth_so_the_stages_fit_shared_memory():
    """Found on an H100: the 16-bit tiles in float32 asked for 245760 bytes of shared memory, past its 232448."""
    for pairs in (32 * 8, 256 * 8, 2048 * 8):
        half, full = plan_moe_launch(pairs, 128, 2), plan_moe_launch(pairs, 128, 4)
        assert full.block_k == half.block_k // 2 and (full.block_m, full.block_n) == (half.block_m, half.block_n)


def test_fp8_products_take_128_columns_by_128_weight_rows_and_16_row_tiles_up_to_16_pairs_an_expert():
    """W8A8: a 16-bit stage's bytes, and act groups of 128 columns (block_n) that the down product's K tile
    (block_k) fits in; past 16 pairs an expert, 32-row tiles (the fastest timed up to 2048 tokens)."""
    for pairs, block_m in ((32 * 8, 16), (256 * 8, 16), (1024 * 8, 32), (2048 * 8, 32)):
        launch = plan_moe_launch(pairs, 128, 1)
        assert (launch.block_m, launch.block_n, launch.block_k) == (block_m, 128, 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_diffusion_gemma_s_experts_through_the_kernel_match_their_loop(dtype):
    """DiffusionGemma's MoE runs the kernel on a GPU and its loop over experts elsewhere: over the same router's
    choices (weights scaled per expert) the two agree, with the checkpoint's own stack layout (gate rows, then up)."""
    from types import SimpleNamespace

    from diffulex_backend.models.diffusion_gemma import GemmaMoE

    arch = SimpleNamespace(hidden_size=64, num_experts=8, moe_intermediate_size=48, top_k_experts=2, rms_norm_eps=1e-6)
    moe = GemmaMoE(arch).to(device=DEVICE)
    gen = generator(18)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(randn(*param.shape, dtype=torch.float32, gen=gen) * param.shape[-1] ** -0.5)
        moe.per_expert_scale.copy_(1 + randn(8, dtype=torch.float32, gen=gen).abs())
        moe.to(dtype)
        x = randn(40, 64, dtype=dtype, gen=gen)
        experts, weights = moe.route(randn(40, 64, dtype=dtype, gen=gen))
        assert weights.dtype == torch.float32 and len(experts.unique()) > 4
        loop = moe.experts_loop(x, experts, weights)
        kernel = fused_moe(x, moe.gate_up_proj, moe.down_proj, experts, weights, activation=GELU_TANH)
    assert relative_error(kernel, loop) < REL_TOL[dtype]
