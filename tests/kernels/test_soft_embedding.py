"""dmax's soft input kernel gives the torch reference's rows (decoder_lm.soft_embeddings) in both merge modes, with
and without renormalizing, for any top-k width, and a row of merge weight 0 is its token's embedding bit for bit."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend.models.decoder_lm import SoftInputs, TokenMerge, soft_embeddings as reference
from diffulex_kernels.soft_embedding import soft_embeddings
from kernel_cases import DEVICE, REL_TOL, generator, randn, relative_error

VOCAB, HIDDEN, MASK = 50, 1100, 49  # a hidden size past one 1024-wide slice, ragged


def inputs(k: int, dtype: torch.dtype):
    gen = generator(k)
    weight = randn(VOCAB, HIDDEN, dtype=dtype, gen=gen)
    rows = 7
    input_ids = torch.tensor([3, MASK, 5, 8, 13, 21, 34], device=DEVICE)
    ids = torch.randint(0, VOCAB - 1, (rows, k), generator=gen, device=DEVICE)
    probs = torch.rand(rows, k, generator=gen, device=DEVICE)
    probs = probs / probs.sum(1, keepdim=True) * torch.tensor([0.9, 1.0, 0.3, 1.4, 0.0, 0.6, 1.0],
                                                              device=DEVICE)[:, None]  # sums below, at, past 1
    merge_weight = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 0.0], device=DEVICE)
    coef = torch.cat([probs, merge_weight[:, None]], 1).float()
    return weight, input_ids, ids, coef


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode, renormalize", [("dmax_topk", True), ("dmax_topk", False),
                                               ("iter_smooth_topk", False)])
@pytest.mark.parametrize("k", [1, 3])
def test_soft_rows_match_the_reference(k, mode, renormalize, dtype):
    weight, input_ids, ids, coef = inputs(k, dtype)
    merge = TokenMerge(MASK, mode, renormalize, k)
    expected = reference(lambda t: torch.nn.functional.embedding(t, weight), input_ids, SoftInputs(ids, coef, merge))
    out = soft_embeddings(weight, input_ids, ids, coef, MASK, smooth=mode == "iter_smooth_topk",
                          renormalize=renormalize)
    assert out.dtype == dtype
    assert relative_error(out, expected) < (1e-6 if dtype == torch.float32 else REL_TOL[dtype])
    hard = coef[:, -1] == 0
    assert torch.equal(out[hard], weight[input_ids[hard]])  # weight 0: the token's own embedding
    assert not torch.equal(out[~hard], weight[input_ids[~hard]])


@pytest.mark.parametrize("mask_token_id", [0, 1])  # Triton folds an int argument of 1 into a constant
def test_any_mask_token_id_compiles_and_mixes_its_row(mask_token_id):
    weight, input_ids, ids, coef = inputs(1, torch.float32)
    merge = TokenMerge(mask_token_id, "dmax_topk", True, 1)
    expected = reference(lambda t: torch.nn.functional.embedding(t, weight), input_ids, SoftInputs(ids, coef, merge))
    out = soft_embeddings(weight, input_ids, ids, coef, mask_token_id, smooth=False, renormalize=True)
    assert relative_error(out, expected) < 1e-6


def test_mismatched_coefficients_are_refused():
    weight, input_ids, ids, coef = inputs(2, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        soft_embeddings(weight, input_ids, ids, coef[:, :2], MASK, smooth=False, renormalize=True)
