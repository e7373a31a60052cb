"""The mixture-of-experts MLP that LLaDA2 and SDAR-MoE share: a router, routed experts stored stacked, and an
optional shared expert.

In the fused forward (`fused_forward._moe`, on CUDA) the router is a split-K product whose partial sums one Triton
kernel adds up and routes (`route_experts`), and the experts run in the fused-MoE kernel, the shared expert among
them at a decode step's few tokens (as more choices per token) and past them as a dense MLP whose sum the kernel's
last step adds; `forward` is the torch path (the CPU's, and the reference): routing by the torch
`select_experts`, the experts by `experts_reference`. Both expert paths read the experts as two stacked
parameters, the layout the kernel wants and the loader packs the per-expert checkpoint tensors into:
- `w_gate_up` [E, 2 * I, H]: rows gate then up;
- `w_down` [E, H, I].

Under tensor parallelism each rank holds a share of every expert's intermediate columns, or with expert
parallelism a share of the experts, whole; every rank routes every token (the router is replicated), runs the
experts it holds on the tokens routed to them, and the partial outputs, the shared expert's included, are summed
over ranks in one all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_backend.layers.fp8_linear import dequantize_weight
from diffulex_backend.layers.mlp import GatedMLP
from diffulex_backend.arch import ModelArch, RouterScore
from diffulex_backend.tensor_parallel import TensorParallel


class MoE(nn.Module):
    # Kept in float32 in a bf16/fp16 model, as the released LLaDA2 keeps its expert_bias buffer: a bias rounded to
    # bf16 would move the selection of experts whose scores are close.
    FLOAT32_PARAMS = ("expert_bias",)

    def __init__(self, arch: ModelArch, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.arch, self.tp = arch, tp
        experts, hidden, inter = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        # A parameter (frozen like every other) rather than a buffer, so the loader fills it like any weight.
        self.expert_bias = nn.Parameter(torch.zeros(experts)) if arch.router_bias else None
        held = tp.experts(experts)
        self.first_expert = held.start
        local_experts = held.stop - held.start
        local_inter = inter if tp.expert_parallel else inter // tp.size
        self.w_gate_up = nn.Parameter(torch.empty(local_experts, 2 * local_inter, hidden))
        self.w_down = nn.Parameter(torch.empty(local_experts, hidden, local_inter))
        # With FP8 weights (quantization.py): the stacks are float8_e4m3fn and these their float32 scales,
        # [E, 2I, G] and [E, H, G]; None in a float model.
        self.register_parameter("w_gate_up_scale", None)
        self.register_parameter("w_down_scale", None)
        shared = arch.num_shared_experts * inter
        self.shared_experts = GatedMLP(hidden, shared, tp, reduce=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """The torch path: the CPU's, and the reference of the fused forward's MoE layer (fused_forward._moe)."""
        # The router runs in float32 (float64 in a float64 model), as the released routers do.
        router_dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(router_dtype), self.gate.weight.to(router_dtype))  # [T, E]
        topk_ids, topk_weights = self.route(logits)
        out = experts_reference(x, self.w_gate_up, self.w_down, topk_ids, topk_weights,
                                self.w_gate_up_scale, self.w_down_scale)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)

    def route(self, logits: torch.Tensor, fused: bool = False, num_shared: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The choices of the experts this rank holds from the router's logits [T, E], or from a split product's
        partial sums [S, T, E] (select_experts); with `num_shared`, the shared experts as that many more choices
        (never under expert parallelism, whose ranks hold their own experts' columns whole and the shared expert's
        in a share)."""
        if num_shared and self.tp.expert_parallel:
            raise ValueError("MoE.route: shared experts run among the routed ones only without expert parallelism")
        topk_ids, topk_weights = select_experts(logits, self.expert_bias, self.arch, fused=fused,
                                                num_shared=num_shared)
        if self.tp.expert_parallel:
            topk_ids, topk_weights = self.held_choices(topk_ids, topk_weights)
        return topk_ids, topk_weights

    def held_choices(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: the choices as indices into the experts this rank holds. A choice of another
        rank's expert keeps weight 0 and points at local expert 0, so the shapes (and a CUDA graph) stay fixed;
        its product is computed and weighted away, a cost of (size - 1) / size of the pairs on one expert."""
        local = topk_ids - self.first_expert
        held = (local >= 0) & (local < self.w_gate_up.shape[0])
        return torch.where(held, local, 0), torch.where(held, topk_weights, 0)


def select_experts(
    logits: torch.Tensor,  # [T, E], the router's output, or its split product's partial sums [S, T, E]
    bias: torch.Tensor | None,  # [E]: added to the scores to pick the experts, never to weight them
    arch: ModelArch,
    fused: bool = False,  # one Triton kernel instead of the torch below (not in float64)
    num_shared: int = 0,  # that many more choices per token: experts E, E + 1, ... at weight 1 (the shared ones)
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_ids [T, K] int64, topk_weights [T, K] float32 (float64 in float64)
    """The experts each token goes through and their weights.

    1. scores: softmax or sigmoid of the logits, in float32 at least (the released routers run in float32);
    2. with groups, each group is scored by the sum of its two best biased scores, and only the experts of the
       `topk_groups` best groups stay eligible;
    3. the K best biased scores among the eligible experts are selected;
    4. their weights are the unbiased scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`;
    5. with `num_shared`, the shared experts follow as experts E to E + num_shared - 1 at weight 1 (the fused-MoE
       kernel runs them among the routed ones: diffulex_kernels.moe.SharedExperts).
    Equal scores go to the lower expert (and group) index: torch.topk leaves their order open, a stable sort
    does not, so the CPU reference and the GPU agree on ties.

    The ids come best first in both paths. `fused` runs all four steps as `route_experts`, one launch where the
    torch steps below take about fifteen per layer; the torch is its reference and the CPU path. The choice is made
    here, not in `MoE.forward`, so that whoever wraps this function (benchmarks/forward.py records the routing)
    sees both paths.
    """
    if fused and logits.dtype != torch.float64:
        # Imports Triton: only when asked.
        from diffulex_kernels.moe_routing import SIGMOID, SOFTMAX, route_experts

        return route_experts(
            logits, bias, top_k=arch.num_experts_per_tok, num_groups=arch.num_expert_groups,
            topk_groups=arch.topk_groups, score=SIGMOID if arch.router_score is RouterScore.SIGMOID else SOFTMAX,
            renormalize=arch.norm_topk_prob, scaling=arch.routed_scaling_factor, num_shared=num_shared,
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype) if logits.dim() == 2 else logits.to(dtype).sum(0)
    scores = logits.sigmoid() if arch.router_score is RouterScore.SIGMOID else logits.softmax(dim=-1)
    biased = scores if bias is None else scores + bias.to(dtype)
    if arch.num_expert_groups > 1:
        tokens = biased.shape[0]
        grouped = biased.view(tokens, arch.num_expert_groups, -1)  # [T, G, E / G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        best_groups = _top_indices(group_scores, arch.topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        biased = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, -1)
    topk_ids = _top_indices(biased, arch.num_experts_per_tok)
    weights = scores.gather(1, topk_ids)
    if arch.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return with_shared_choices(topk_ids, weights * arch.routed_scaling_factor, arch.num_experts, num_shared)


def with_shared_choices(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, num_shared: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing [T, K] with num_shared more choices per token: experts num_experts, num_experts + 1, ... at
    weight 1 (what route_experts' num_shared writes)."""
    if not num_shared:
        return topk_ids, topk_weights
    tokens = topk_ids.shape[0]
    shared = torch.arange(num_experts, num_experts + num_shared, device=topk_ids.device).expand(tokens, num_shared)
    return (torch.cat([topk_ids, shared], dim=1),
            torch.cat([topk_weights, topk_weights.new_ones(tokens, num_shared)], dim=1))


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:  # [T, N] -> [T, k] int64, ties to the lower index
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def experts_reference(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2 * I, H]: rows gate then up
    w_down: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] int64
    topk_weights: torch.Tensor,  # [T, K]
    w_gate_up_scale: torch.Tensor | None = None,  # [E, 2 * I, G] float32 when the stacks are fp8
    w_down_scale: torch.Tensor | None = None,  # [E, H, G]
) -> torch.Tensor:  # [T, H] in x's dtype
    """out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]: the fused
    kernel's contract, in torch. One matmul per expert that got tokens; the (token, choice) pairs are sorted by
    expert so each expert reads a contiguous slice. The counts go to the host, so this path is not for CUDA
    graphs; on CUDA the kernel runs instead. FP8 stacks are dequantized one expert at a time (the reference of the
    kernel's fp8 path)."""
    tokens, k = topk_ids.shape
    inter = w_down.shape[-1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
    pair_token = order // k
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
    pair_out = x.new_empty(tokens * k, x.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        xs = x[pair_token[rows]]
        gate_up, down = w_gate_up[expert], w_down[expert]
        if w_gate_up_scale is not None:
            gate_up = dequantize_weight(gate_up, w_gate_up_scale[expert]).to(x.dtype)
            down = dequantize_weight(down, w_down_scale[expert]).to(x.dtype)
        gate, up = F.linear(xs, gate_up).split(inter, dim=-1)
        pair_out[rows] = F.linear(F.silu(gate) * up, down)
        start += count
    # Weighted and summed in the weights' float32 (float64) precision, as the released models combine them.
    weighted = pair_out.to(topk_weights.dtype) * topk_weights.reshape(-1)[order, None]
    out = torch.zeros(x.shape, dtype=topk_weights.dtype, device=x.device).index_add_(0, pair_token, weighted)
    return out.to(x.dtype)
