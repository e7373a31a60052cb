"""dmax's soft input rows in one launch: the kernel twin of `diffulex_backend.models.decoder_lm.soft_embeddings`.

Each row is its token's embedding e, or, with merge weight w > 0, e + w (x - e) where x mixes the embeddings e_k of
the row's top-k tokens with probabilities p_k:
  mixture (dmax_topk):  x = sum_k p_k e_k + r m,  r = max(0, 1 - sum_k p_k),  m = the mask token's embedding,
                        rescaled (renormalize) to the norm sum_k p_k |e_k| + r |m|;
  smooth (iter_smooth_topk):  e + w sum_k p_k e_k.
The torch form is some thirty launches at decode sizes, each a node of the decode graph that the host must launch
and the GPU must drain; here a program takes one row, in float32. A row of weight 0 (masked, committed, or
padding) is a copy of its token's embedding. The rescale needs the norms of the whole row first, so a mixed row is
read twice, from L2 the second time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl, wait_for_previous_kernel

BLOCK_H = 1024  # hidden entries per loop step


@triton.jit
def _mixture(weight_ptr, stride_w, ids, probs, rest, mask_row, hs, h_mask, SMOOTH: tl.constexpr):
    """[K tile, BLOCK_H] of the top-k embeddings, and sum_k p_k e_k (+ r m unless SMOOTH) over this slice."""
    k_valid = probs != 0.0  # padded k entries have probability 0 and id 0
    e = tl.load(weight_ptr + ids[:, None] * stride_w + hs[None, :], mask=k_valid[:, None] & h_mask[None, :],
                other=0.0).to(tl.float32)
    mixed = tl.sum(probs[:, None] * e, axis=0)
    if not SMOOTH:
        mixed += rest * tl.load(mask_row + hs, mask=h_mask, other=0.0).to(tl.float32)
    return e, mixed


@triton.jit(do_not_specialize=["mask_token_id"])  # kept a tensor whatever its value: its int64 cast below
def _soft_embedding_kernel(weight_ptr, input_ids_ptr, ids_ptr, coef_ptr, out_ptr, stride_w, stride_ids, stride_coef,
                           stride_out, hidden, mask_token_id, K, K_TILE: tl.constexpr, SMOOTH: tl.constexpr,
                           RENORMALIZE: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    token_row = weight_ptr + tl.load(input_ids_ptr + row).to(tl.int64) * stride_w
    out_row = out_ptr + row * stride_out
    w = tl.load(coef_ptr + row * stride_coef + K)
    offsets = tl.arange(0, BLOCK_H)
    if w == 0.0:
        for h0 in range(0, hidden, BLOCK_H):
            hs = h0 + offsets
            tl.store(out_row + hs, tl.load(token_row + hs, mask=hs < hidden), mask=hs < hidden)
    else:
        ks = tl.arange(0, K_TILE)
        k_mask = ks < K
        probs = tl.load(coef_ptr + row * stride_coef + ks, mask=k_mask, other=0.0)
        ids = tl.load(ids_ptr + row * stride_ids + ks, mask=k_mask, other=0).to(tl.int64)
        rest = tl.maximum(1.0 - tl.sum(probs, axis=0), 0.0)
        mask_row = weight_ptr + mask_token_id.to(tl.int64) * stride_w
        scale = 1.0
        if RENORMALIZE and not SMOOTH:
            sq_k = tl.zeros((K_TILE,), dtype=tl.float32)  # |e_k|^2
            sq_mask = 0.0
            sq_mixed = 0.0
            for h0 in range(0, hidden, BLOCK_H):
                hs = h0 + offsets
                h_mask = hs < hidden
                e, mixed = _mixture(weight_ptr, stride_w, ids, probs, rest, mask_row, hs, h_mask, SMOOTH)
                m = tl.load(mask_row + hs, mask=h_mask, other=0.0).to(tl.float32)
                sq_k += tl.sum(e * e, axis=1)
                sq_mask += tl.sum(m * m, axis=0)
                sq_mixed += tl.sum(mixed * mixed, axis=0)
            target = tl.sum(probs * tl.sqrt(sq_k), axis=0) + rest * tl.sqrt(sq_mask)
            scale = target / tl.maximum(tl.sqrt(sq_mixed), 1e-12)
        for h0 in range(0, hidden, BLOCK_H):
            hs = h0 + offsets
            h_mask = hs < hidden
            _, mixed = _mixture(weight_ptr, stride_w, ids, probs, rest, mask_row, hs, h_mask, SMOOTH)
            hard = tl.load(token_row + hs, mask=h_mask, other=0.0).to(tl.float32)
            if SMOOTH:
                fed = hard + w * mixed
            else:
                fed = hard + w * (mixed * scale - hard)
            tl.store(out_row + hs, fed.to(out_ptr.dtype.element_ty), mask=h_mask)


def soft_embeddings(weight: torch.Tensor, input_ids: torch.Tensor, ids: torch.Tensor, coef: torch.Tensor,
                    mask_token_id: int, smooth: bool, renormalize: bool) -> torch.Tensor:
    """[T, hidden] in weight's dtype: weight [vocab, hidden] the embedding table, input_ids [T], ids [T, K] the
    top-k tokens, coef [T, K + 1] float32 their probabilities then the row's merge weight. smooth: the
    iter_smooth_topk mode, else dmax_topk; renormalize applies to dmax_topk only."""
    num_tokens, hidden = input_ids.shape[0], weight.shape[1]
    k = ids.shape[1]
    if weight.stride(1) != 1 or ids.stride(1) != 1 or coef.stride(1) != 1:
        raise ValueError("soft_embeddings: weight, ids and coef need a contiguous last dimension")
    if coef.shape != (num_tokens, k + 1) or ids.shape[0] != num_tokens:
        raise ValueError(f"soft_embeddings: ids {tuple(ids.shape)} and coef {tuple(coef.shape)} do not fit "
                         f"{num_tokens} rows of K + 1 coefficients")
    out = torch.empty(num_tokens, hidden, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    pdl = use_pdl(weight)
    _soft_embedding_kernel[(num_tokens,)](
        weight, input_ids, ids, coef, out, weight.stride(0), ids.stride(0), coef.stride(0), out.stride(0), hidden,
        mask_token_id, k, K_TILE=max(2, triton.next_power_of_2(k)), SMOOTH=smooth, RENORMALIZE=renormalize,
        BLOCK_H=min(BLOCK_H, triton.next_power_of_2(hidden)), USE_PDL=pdl, launch_pdl=pdl)
    return out
