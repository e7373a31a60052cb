"""The decoder forward with Triton kernels, for CUDA: the same parameters and math as the torch modules (the
reference and the CPU path), in fewer launches.

- Each residual add is folded into the RMSNorm that follows it (`fused_add_rmsnorm`), and the final norm into
  the last layer's, so the residual stream is read and written once per norm.
- RoPE rotates q and k in place in one launch, inside the fused qkv projection's output, after their per-head
  norms where the model has them; that launch also stores the K/V of tokens with a cache slot, so the attention
  does not launch a store.
- Up to `MAX_TOKENS` tokens the matmuls are the weight-streaming kernel of `diffulex_kernels.linear`; o_proj and
  down_proj hand their split-K partial sums to the residual-add RMSNorm after them, which adds them up, and the
  gate_up projection applies SiLU-and-mul in its epilogue. Past that, SiLU-and-mul is one launch of its own.
At batch 1 a layer is then eight launches (nine with split-KV's merge), four of them weight-streaming matmuls:
small kernels would otherwise cost more than the weights take to stream.
- Under tensor parallelism o_proj's and down_proj's partial sums are summed over the ranks as well: where the
  ranks share peer memory and the rows fit its staging buffer, one launch sums them over the splits and the ranks
  and ends in the residual-add RMSNorm (`_sum_add_norm`), so the sums add no launch to a layer; otherwise an
  all-reduce comes before the norm.
- A MoE layer's MLP (LLaDA2, SDAR-MoE, `_moe`): the router as the streaming kernel's split product, whose float32
  partial sums the group-limited top-k kernel (`diffulex_kernels.route_experts`) adds up as it routes. Up to
  `SHARED_AMONG_ROUTED_MAX_TOKENS` tokens the shared expert runs among the routed ones, in the fused-MoE kernel's
  launches (the routing names it as one more choice per token, at weight 1); past that, as a dense gated MLP
  (above), whose partial sums the fused-MoE kernel adds to each token's routed sum in its last step. With fp8
  experts the tokens are cast once for the routed and the shared experts. Its [T, hidden] output goes to the same
  residual-add RMSNorm. Dense layers of a MoE model take the dense path above.
- q and k are normed per head (LLaDA2, SDAR, DreamReasoner and other Qwen3-style models), rotated (partially for
  LLaDA2: each head's first rotary_dim values), and stored with v into the cache for the tokens that have a slot, in
  place over the qkv rows, in one launch (`diffulex_kernels.rotary`).
- FP8 projections (`Fp8Linear`, quantization.py) take the W8A8 product of `diffulex_kernels.fp8` in place of the
  streaming kernel, o_proj and down_proj as split-K partial sums too, and gate_up with SiLU-and-mul in its epilogue
  up to the kernel's rows (`fp8_silu_and_mul`), as a launch of its own past them.
  The norms before qkv and gate_up, the SiLU-and-mul before down_proj, and the attention before o_proj cast their
  rows to fp8 with a scale per row as they write them (`Fp8Rows`), so those inputs are written in one byte a value
  and need no cast launch of their own; the attention casts in its merge of split-KV partials, which holds a
  token's every head, and takes `quantize_rows` where it does not split. A projection with a LoRA delta in the
  forward gets the float rows, which the delta reads.
- dmax's soft input rows are mixed in one launch (`diffulex_kernels.soft_embedding`) rather than some thirty torch
  ops, each a node of the decode graph; under tensor parallelism the sharded table takes the torch form.
- LoRA adapters chosen per request (`lora`, a LoraSegments): each adapted projection adds its delta with the
  segmented shrink/expand kernels (`diffulex_kernels.lora`), two launches each: qkv before RoPE, o_proj and
  down_proj onto their first split-K partial sum (the norm after them adds the rest). gate_up's expand is folded
  into the SiLU-and-mul that reads the plain product (the streaming kernel's fused epilogue has no place for a
  delta before the SiLU): its wide output is then read once, not written and read again. A forward without
  `lora` launches none of this.
Roundings differ from the torch modules only where a kernel keeps float32 between two ops that the modules round
in between.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.fp8_linear import Fp8Linear
from diffulex_backend.layers.lora import LoraSegments, LoraStack, row_slots
from diffulex_backend.layers.mlp import GatedMLP
from diffulex_backend.layers.moe import MoE
from diffulex_backend.layers.rotary import rotary_angles
from diffulex_backend.layers.self_attention import SelfAttention
from diffulex_backend.tensor_parallel import TensorParallel
from diffulex_kernels import fused_add_rmsnorm, rmsnorm
from diffulex_kernels.activation import silu_and_mul
from diffulex_kernels.fp8 import fp8_linear, fp8_rows_linear, fp8_rows_partials, fp8_silu_and_mul, quantize_rows
from diffulex_kernels.linear import MAX_TOKENS, linear, linear_partials, linear_silu_and_mul
from diffulex_kernels.norm import fused_add_rmsnorm_fp8, rmsnorm_fp8
from diffulex_kernels.lora import add_lora_segments, shrink, silu_and_mul_lora
from diffulex_kernels.moe import SharedExperts, fused_moe, shared_experts_misfit
from diffulex_kernels.rotary import HeadNorm, rotate_and_store_kv, rotate_in_place
from diffulex_kernels.soft_embedding import soft_embeddings


def fused_forward(
    model,  # DecoderLM
    input_ids: torch.Tensor,  # [T] long
    positions: torch.Tensor,  # [T] long
    meta: AttentionMetadata,
    kv_cache: torch.Tensor | None,  # [2, num_layers, num_pages, page_size, kv_heads, head_dim]
    soft=None,  # models.decoder_lm.SoftInputs: rows fed as embedding mixtures (dmax)
    lora: LoraSegments | None = None,  # which rows take which adapter; None: no adapter
) -> torch.Tensor:  # [T, hidden], after the final norm
    cos, sin = rotary_angles(positions, model.arch.rotary_dim, model.arch.rope_theta)  # float32, as the kernel wants
    if soft is not None and model.tp.size == 1:  # one launch; under tensor parallelism the table is sharded
        merge = soft.merge
        residual = soft_embeddings(model.embed_tokens.weight, input_ids, soft.ids, soft.coef, merge.mask_token_id,
                                   smooth=merge.mode == "iter_smooth_topk", renormalize=merge.renormalize)
    else:
        residual = model.input_embeddings(input_ids, soft)
    first_norm = model.layers[0].attn_norm
    if _takes_fp8_rows(model.layers[0].attn.qkv_proj, model.layers[0].attn.qkv_lora, lora):
        x = Fp8Rows(*rmsnorm_fp8(residual, first_norm.weight, first_norm.eps), residual.dtype)
    else:
        x = rmsnorm(residual, first_norm.weight, first_norm.eps)
    norms_after = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    # Whether each norm's rows go to an fp8 qkv projection: the next layer's (none after the final norm).
    qkv_after = [_takes_fp8_rows(layer.attn.qkv_proj, layer.attn.qkv_lora, lora) for layer in model.layers[1:]]
    qkv_after.append(False)
    slots = None  # each row's adapter slot, for gate_up's SiLU
    if lora is not None and any(getattr(layer.mlp, "gate_up_lora", None) is not None for layer in model.layers):
        slots = row_slots(lora.table, input_ids.shape[0])
    for index, (layer, next_norm) in enumerate(zip(model.layers, norms_after)):
        k_cache = v_cache = None
        if kv_cache is not None:
            k_cache, v_cache = kv_cache[0, index], kv_cache[1, index]
        attn_out = _self_attention(layer.attn, x, cos, sin, meta, k_cache, v_cache, lora)
        mlp = layer.mlp
        fp8_mlp = isinstance(mlp, GatedMLP) and _takes_fp8_rows(mlp.gate_up_proj, mlp.gate_up_lora, lora)
        x, residual = _sum_add_norm(model.tp, attn_out, residual, layer.mlp_norm, fp8_mlp)
        if isinstance(mlp, MoE):  # its rows come summed over the ranks
            x, residual = _add_norm(_moe(mlp, x), residual, next_norm, qkv_after[index])
        else:
            x, residual = _sum_add_norm(model.tp, _gated_mlp(mlp, x, lora, slots), residual, next_norm,
                                        qkv_after[index])
    return x


class Fp8Rows(NamedTuple):
    """Normalized rows already cast for an FP8 projection, by the norm that wrote them."""

    q: torch.Tensor  # [T, hidden] float8_e4m3fn
    scale: torch.Tensor  # [T] float32
    dtype: torch.dtype  # the activations' dtype, the projection's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def _takes_fp8_rows(proj, stack: LoraStack | None, lora: LoraSegments | None) -> bool:
    """Whether a projection's input goes to it cast by the norm before it: an fp8 projection whose input no LoRA
    delta reads in its float form."""
    return isinstance(proj, Fp8Linear) and (stack is None or lora is None)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm, fp8: bool):
    """fused_add_rmsnorm; with `fp8` the normalized rows come cast for the fp8 projection after it."""
    if fp8:
        rows, residual = fused_add_rmsnorm_fp8(x, residual, norm.weight, norm.eps)
        return Fp8Rows(*rows, residual.dtype), residual
    return fused_add_rmsnorm(x, residual, norm.weight, norm.eps)


def _sum_add_norm(tp: TensorParallel, partials: torch.Tensor, residual: torch.Tensor, norm, fp8: bool):
    """A row-parallel product's partial sums ([S, T, hidden]) summed over the ranks (_sum_over_ranks), added to the
    residual and normalized (_add_norm). Over peer memory one launch does all of it; every rank takes the same way,
    since every rank holds the same shapes."""
    peer = tp.peer
    if (tp.size > 1 and partials.dim() == 3 and peer is not None and partials.is_contiguous()
            and residual.is_contiguous() and peer.fits(partials[0], summed=True)):
        rows, residual = peer.sum_add_rmsnorm(partials, residual, norm.weight, norm.eps, fp8)
        return (Fp8Rows(*rows, residual.dtype) if fp8 else rows), residual
    return _add_norm(_sum_over_ranks(tp, partials), residual, norm, fp8)


def _sum_over_ranks(tp: TensorParallel, partials: torch.Tensor) -> torch.Tensor:
    """A row-parallel product's partial sums ([S, T, hidden]) as they go to the residual-add norm: unchanged on one
    rank (the norm adds them up); under tensor parallelism summed here and over ranks, in their dtype: float32 from
    the streaming kernel and the Triton fp8 kernel, the activation dtype from cuBLAS past its MAX_TOKENS rows and
    from cuBLASLt's fp8 product (one product, S = 1), where the all-reduce then moves half the bytes and each rank's
    share is rounded before the sum."""
    if tp.size == 1:
        return partials
    return tp.sum_partials(partials) if partials.dim() == 3 else tp.all_reduce(partials)


def _add_lora(out: torch.Tensor, x: torch.Tensor, stack: LoraStack | None, lora: LoraSegments | None) -> torch.Tensor:
    """out += the LoRA delta of x, in place, through the segmented kernels (the interpreter's on the CPU); nothing
    without an adapted projection or adapter rows."""
    if stack is None or lora is None:
        return out
    return add_lora_segments(out, x, stack.a, stack.b, lora.table, lora.max_rows)


def _add_to_first_partial(partials: torch.Tensor, x: torch.Tensor, stack: LoraStack | None,
                          lora: LoraSegments | None) -> torch.Tensor:
    """A row-parallel product's partial sums ([S, T, N], or [T, N] from one rank's sum) with the LoRA delta of its
    input x added to the first of them, in place: their sum is then the adapted product."""
    _add_lora(partials[0] if partials.dim() == 3 else partials, x, stack, lora)
    return partials


def _project(proj, x: torch.Tensor | Fp8Rows) -> torch.Tensor:  # [T, N]
    if isinstance(x, Fp8Rows):
        return fp8_rows_linear(x.q, x.scale, proj.weight, proj.weight_scale, proj.bias, x.dtype)
    if isinstance(proj, Fp8Linear):
        return fp8_linear(x, proj.weight, proj.weight_scale, proj.bias)
    return linear(x, proj.weight, proj.bias)


def _project_partials(proj, x: torch.Tensor | Fp8Rows) -> torch.Tensor:  # [S, T, N]
    """A row-parallel projection (o_proj, down_proj: no bias) as the partial sums its norm adds up."""
    if isinstance(proj, Fp8Linear):
        rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quantize_rows(x.contiguous()), x.dtype)
        return fp8_rows_partials(rows.q, rows.scale, proj.weight, proj.weight_scale, rows.dtype)
    return linear_partials(x, proj.weight)


def _project_silu_and_mul(proj, x: torch.Tensor | Fp8Rows) -> torch.Tensor:  # [T, N / 2]
    if isinstance(proj, Fp8Linear):
        return silu_and_mul(_project(proj, x))
    return linear_silu_and_mul(x, proj.weight)


def _gated_mlp(mlp: GatedMLP, x: torch.Tensor, lora: LoraSegments | None,
               slots: torch.Tensor | None) -> torch.Tensor:  # [S, T, hidden]
    """down_proj's partial sums of silu(gate) * up; slots: each row's adapter slot, with `lora`."""
    stack = mlp.gate_up_lora
    if (lora is None or stack is None) and isinstance(mlp.gate_up_proj, Fp8Linear) and _takes_fp8_rows(
            mlp.down_proj, mlp.down_lora, lora):
        # SiLU-and-mul in the product's epilogue, its rows cast for the fp8 down projection (x.dtype: the
        # activations', either form).
        rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quantize_rows(x.contiguous()), x.dtype)
        proj = mlp.gate_up_proj
        h = Fp8Rows(*fp8_silu_and_mul(rows.q, rows.scale, proj.weight, proj.weight_scale, rows.dtype, proj.bias),
                    x.dtype)
    elif lora is None or stack is None:
        h = _project_silu_and_mul(mlp.gate_up_proj, x)  # [T, intermediate]
    else:
        h = silu_and_mul_lora(_project(mlp.gate_up_proj, x), shrink(x, stack.a, lora.table, lora.max_rows),
                              stack.b, slots)
    return _add_to_first_partial(_project_partials(mlp.down_proj, h), h, mlp.down_lora, lora)


# Up to this many tokens a MoE layer's shared experts run among the routed ones, in the fused-MoE kernel's launches
# (SharedExperts): their own three or four launches (gate_up, the SiLU-and-mul, down) cost more than the weight
# reads that each further tile of them adds. Past it they run as a dense MLP, which reads their weights once.
SHARED_AMONG_ROUTED_MAX_TOKENS = 64


def _moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:  # [T, hidden], summed over ranks
    """A MoE layer's MLP: the router, the routing kernel and the routed experts in the fused-MoE kernel; the shared
    experts among the routed ones (`_shared_among_routed`), or as a dense gated MLP whose partial sums the kernel's
    last step adds. With fp8 experts the tokens are cast once, for both."""
    among_routed = _shared_among_routed(moe, x.shape[0])
    num_shared = among_routed.count(moe.w_down.shape[-1]) if among_routed is not None else 0
    topk_ids, topk_weights = moe.route(_router_logits(moe, x), fused=True, num_shared=num_shared)
    rows = Fp8Rows(*quantize_rows(x), x.dtype) if moe.w_gate_up_scale is not None else None
    shared = None
    if moe.shared_experts is not None and among_routed is None:
        takes_rows = rows is not None and isinstance(moe.shared_experts.gate_up_proj, Fp8Linear)
        shared = _gated_mlp(moe.shared_experts, rows if takes_rows else x, None, None)  # [S, T, hidden]
    out = fused_moe(x, moe.w_gate_up, moe.w_down, topk_ids, topk_weights, w_gate_up_scale=moe.w_gate_up_scale,
                    w_down_scale=moe.w_down_scale, rows=(rows.q, rows.scale) if rows is not None else None,
                    shared=shared, shared_experts=among_routed)
    return moe.tp.all_reduce(out)


def _shared_among_routed(moe: MoE, tokens: int) -> SharedExperts | None:
    """The layer's shared experts as experts of the fused-MoE kernel, where they run there: up to
    SHARED_AMONG_ROUTED_MAX_TOKENS tokens, without expert parallelism (whose ranks hold the routed experts whole and
    the shared ones in a share), and with weights laid out as whole experts of the stacks' (their dtype, their
    columns, their scales' shapes)."""
    mlp = moe.shared_experts
    if mlp is None or tokens > SHARED_AMONG_ROUTED_MAX_TOKENS or moe.tp.expert_parallel:
        return None
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if gate_up.bias is not None or down.bias is not None:
        return None
    shared = SharedExperts(gate_up.weight, down.weight, getattr(gate_up, "weight_scale", None),
                           getattr(down, "weight_scale", None))
    misfit = shared_experts_misfit(shared, moe.w_gate_up, moe.w_down, moe.w_gate_up_scale, moe.w_down_scale)
    return shared if misfit is None else None


def _router_logits(moe: MoE, x: torch.Tensor) -> torch.Tensor:  # [S, T, experts]
    """The router's logits in float32, as the released routers compute them, and as partial sums that the routing
    kernel adds up: up to MAX_TOKENS rows of a 16-bit model, the streaming kernel's split product, whose products of
    16-bit values are exact in float32 and whose sums are float32, with no cast of the rows or the weight; else one
    product in float32 (float64 in a float64 model)."""
    weight = moe.gate.weight
    if x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= MAX_TOKENS:
        return linear_partials(x, weight)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))[None]


def _self_attention(
    attn: SelfAttention,
    x: torch.Tensor,  # [T, hidden]
    cos: torch.Tensor,
    sin: torch.Tensor,
    meta: AttentionMetadata,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    lora: LoraSegments | None = None,
) -> torch.Tensor:  # [S, T, hidden]: o_proj's partial sums
    tokens = x.shape[0]
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_size, kv_size, _ = attn.split_sizes
    qkv = _add_lora(_project(attn.qkv_proj, x), x, attn.qkv_lora, lora)  # [T, q + 2 kv]
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
    # q and k are adjacent columns of qkv: one [T, heads + kv_heads, head_dim] view norms (SDAR, LLaDA2,
    # DreamReasoner) and rotates both, and the same launch stores the k and v of the tokens that have a cache slot.
    # q_norm and k_norm are built with the one rms_norm_eps of the model, so q's eps serves both.
    qk = qkv[:, :q_size + kv_size].view(tokens, heads + kv_heads, head_dim)
    norm = None if attn.q_norm is None else HeadNorm(attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, heads)
    kv_stored = k_cache is not None
    if kv_stored:
        rotate_and_store_kv(qk, v, cos, sin, k_cache, v_cache, meta.slot_mapping, norm)
    else:
        rotate_in_place(qk, cos, sin, norm)
    # The Triton kernel, or flash_attention.FlashAttention over it: [T, heads, head_dim], or for an fp8 o_proj
    # each token's heads as one row cast to fp8, which the merge of split-KV partials casts as it writes them.
    if _takes_fp8_rows(attn.o_proj, attn.o_lora, lora):
        out = Fp8Rows(*attn.attention_fn(q, k, v, k_cache, v_cache, meta, attn.scale, kv_stored=kv_stored,
                                         fp8_out=True), qkv.dtype)
    else:
        out = attn.attention_fn(q, k, v, k_cache, v_cache, meta, attn.scale, kv_stored=kv_stored)
        out = out.reshape(tokens, q_size)
    if meta.retention_stats is not None:  # the one eager forward that measures attention for page retention
        meta.retention_stats.add(q, k_cache, meta, attn.scale)
    return _add_to_first_partial(_project_partials(attn.o_proj, out), out, attn.o_lora, lora)
