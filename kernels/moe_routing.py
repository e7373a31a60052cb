"""Group-limited top-k routing of a mixture-of-experts layer in one kernel.

    scores = softmax(logits) or sigmoid(logits), in float32
    biased = scores + expert_bias (the bias picks experts, it never weights them)
    with groups: each group is scored by the sum of its two best biased scores, and only the experts of the
        `topk_groups` best groups stay eligible
    topk_ids = the K best biased scores among the eligible experts, best first, equal scores to the lower index
    topk_weights = scores[topk_ids], renormalised to sum to 1 when asked, times `scaling`
    then, with `num_shared`, that many more choices per token: experts E, E + 1, ... at weight 1 (a MoE layer's
        shared experts, which the expert kernels run among the routed ones: kernels/moe.py)

The torch version (a softmax, casts, two stable sorts, a gather and a few element-wise steps) is about fifteen
launches per MoE layer; at decode they cost more than the experts' weights take to stream. Here one program takes
one token: its row of E logits (E up to a few hundred) sits in registers as a [groups, experts per group] tile, the
group scores come from a two-max reduction along the rows, and groups and experts are picked by repeated argmax
passes that mask what they already took. Each pass picks the lowest index among the maxima of what is left, so the
ids come out in the order of a stable descending sort, the order the torch version returns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_for_previous_kernel

SOFTMAX, SIGMOID = 0, 1


@triton.jit
def _pick_best(values, taken, index, BIG: tl.constexpr):
    """The index of the largest of `values` not yet `taken`, the lowest such index on ties."""
    best = tl.max(tl.max(tl.where(taken != 0, float("-inf"), values), 1), 0)
    candidates = (values == best) & (taken == 0)
    return tl.min(tl.min(tl.where(candidates, index, BIG), 1), 0)


# The number of tokens changes with every batch, and the partials' stride (T x E) with it.
@triton.jit(do_not_specialize=["stride_s"])
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_s, stride_t, num_experts, scaling,
    GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, G_POW2: tl.constexpr, GS_POW2: tl.constexpr,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, TOPK_GROUPS: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, BIG: tl.constexpr, NUM_PARTIALS: tl.constexpr, NUM_SHARED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The logits are the sum, in order and in float32, of NUM_PARTIALS partial sums stride_s apart. Each token's
    row of ids and weights holds TOP_K routed choices, then NUM_SHARED shared experts."""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, G_POW2)[:, None]
    member = tl.arange(0, GS_POW2)[None, :]
    expert = group * GROUP_SIZE + member  # [G_POW2, GS_POW2]
    valid = (group < NUM_GROUPS) & (member < GROUP_SIZE)
    logits_ptrs = logits_ptr + token * stride_t + expert
    logits = tl.load(logits_ptrs, mask=valid, other=float("-inf")).to(tl.float32)
    for s in tl.static_range(1, NUM_PARTIALS):
        logits += tl.load(logits_ptrs + s * stride_s, mask=valid, other=0.0).to(tl.float32)
    if SCORE == 0:
        shifted = tl.exp(logits - tl.max(tl.max(logits, 1), 0))  # padding: exp(-inf) = 0
        scores = shifted / tl.sum(tl.sum(shifted, 1), 0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    if HAS_BIAS:
        biased = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    else:
        biased = scores
    # A NaN score (a row of NaN or infinite logits: garbage in a CUDA graph's padding rows, or an overflowed
    # input) ranks last, as -inf: NaN equals no maximum, and a pass that found no candidate would hand the
    # expert kernels an index past the last expert, which they use as an address.
    biased = tl.where(valid & (biased == biased), biased, float("-inf"))
    padding = (valid == 0).to(tl.int32)

    if NUM_GROUPS > 1:
        # Group score: the sum of the group's two best biased scores (its best alone in groups of one).
        first = tl.max(biased, 1)  # [G_POW2]
        first_at = tl.min(tl.where(biased == first[:, None], member, GS_POW2), 1)
        if GROUP_SIZE > 1:
            second = tl.max(tl.where(member == first_at[:, None], float("-inf"), biased), 1)
            group_scores = first + second
        else:
            group_scores = first
        group_index = tl.arange(0, G_POW2)[:, None]  # [G_POW2, 1] so _pick_best reduces two axes
        group_scores = group_scores[:, None]
        group_taken = (group_index >= NUM_GROUPS).to(tl.int32)
        kept = tl.zeros([G_POW2, 1], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            best_group = _pick_best(group_scores, group_taken, group_index, G_POW2)
            hit = (group_index == best_group).to(tl.int32)
            group_taken = group_taken | hit
            kept = kept | hit
        biased = tl.where(kept != 0, biased, float("-inf"))

    offs_k = tl.arange(0, K_POW2)
    ids = tl.zeros_like(offs_k)
    weights = tl.zeros(offs_k.shape, dtype=tl.float32)
    taken = padding
    for k in tl.static_range(TOP_K):
        chosen = _pick_best(biased, taken, expert, BIG)
        hit = (expert == chosen) & valid
        taken = taken | hit.to(tl.int32)
        weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)
        ids = tl.where(offs_k == k, chosen, ids)
        weights = tl.where(offs_k == k, weight, weights)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = weights * scaling
    shared = offs_k >= TOP_K
    ids = tl.where(shared, num_experts + offs_k - TOP_K, ids)
    weights = tl.where(shared, 1.0, weights)
    in_row = offs_k < TOP_K + NUM_SHARED
    tl.store(ids_ptr + token * (TOP_K + NUM_SHARED) + offs_k, ids.to(tl.int64), mask=in_row)
    tl.store(weights_ptr + token * (TOP_K + NUM_SHARED) + offs_k, weights, mask=in_row)


def route_experts(router_logits: torch.Tensor, expert_bias: torch.Tensor | None, *, top_k: int, num_groups: int,
                  topk_groups: int, score: int, renormalize: bool, scaling: float, num_shared: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype, scored in float32), or a split product's partial sums [S, T, E],
    added up in order in float32; expert_bias [E] or None; score SOFTMAX (0) or SIGMOID (1); num_groups <= 1 for
    no groups -> topk_ids [T, K + num_shared] int64 (the routed best first, ties to the lower expert, then the
    shared E, E + 1, ...), topk_weights [T, K + num_shared] float32 (the shared ones 1)."""
    partials = router_logits if router_logits.dim() == 3 else router_logits[None]
    if partials.stride(2) != 1:
        partials = partials.contiguous()
    router_logits = partials[0]
    tokens, num_experts = router_logits.shape
    groups = max(num_groups, 1)
    if num_experts % groups or not 1 <= top_k <= num_experts or (groups > 1 and not 1 <= topk_groups <= groups):
        raise ValueError(f"route_experts: {num_experts} experts, {num_groups} groups (keep {topk_groups}), "
                         f"top {top_k}")
    if num_shared < 0:
        raise ValueError(f"route_experts: num_shared must be >= 0, got {num_shared}")
    if expert_bias is not None and expert_bias.shape != (num_experts,):
        raise ValueError(f"route_experts: expert_bias must be [{num_experts}], got {tuple(expert_bias.shape)}")
    ids = torch.empty(tokens, top_k + num_shared, dtype=torch.int64, device=router_logits.device)
    weights = torch.empty(tokens, top_k + num_shared, dtype=torch.float32, device=router_logits.device)
    if tokens == 0:
        return ids, weights
    group_size = num_experts // groups
    bias = expert_bias.contiguous() if expert_bias is not None else router_logits  # never read without a bias
    width = triton.next_power_of_2(num_experts)
    pdl = use_pdl(router_logits)
    _grouped_topk_kernel[(tokens,)](
        router_logits, bias, ids, weights, partials.stride(0), router_logits.stride(0), num_experts, float(scaling),
        GROUP_SIZE=group_size, NUM_GROUPS=groups, G_POW2=triton.next_power_of_2(groups),
        GS_POW2=triton.next_power_of_2(group_size), TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k + num_shared),
        TOPK_GROUPS=topk_groups if groups > 1 else 1,
        SCORE=score, HAS_BIAS=expert_bias is not None, RENORMALIZE=renormalize,
        BIG=triton.next_power_of_2(groups) * group_size + triton.next_power_of_2(group_size),  # above every index
        NUM_PARTIALS=partials.shape[0], NUM_SHARED=num_shared, USE_PDL=pdl, launch_pdl=pdl,
        # A token's picks are some thirty reductions in a row: within one warp they take no barrier, and a warp's
        # 32 lanes hold 256 experts in eight registers each.
        num_warps=1 if width <= 256 else 2,
    )
    return ids, weights
