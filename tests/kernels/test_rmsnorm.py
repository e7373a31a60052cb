"""RMSNorm and the fused residual-add RMSNorm match their torch definitions."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from kernel_cases import FULL_SHAPES, assert_equal_after_rounding, generator, poisoned_like, randn, relative_error

# (tokens, hidden): hidden sizes of LLaDA-8B and Dream-7B, or small ones with a ragged tile.
SHAPES = [(2048, 4096), (2048, 3584)] if FULL_SHAPES else [(7, 256), (5, 96)]
EPS = 1e-5
# One rounding of the output to the activation dtype (a truncation, for bfloat16 under the interpreter).
REL_TOL = {torch.bfloat16: 8e-3, torch.float16: 5e-4, torch.float32: 1e-6}


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rmsnorm_matches_reference(shape, dtype):
    gen = generator(shape[1])
    x = randn(*shape, dtype=dtype, gen=gen) * 4
    weight = randn(shape[1], dtype=dtype, gen=gen)
    out = diffulex_kernels.rmsnorm(x, weight, EPS, out=poisoned_like(x))
    assert relative_error(out, rmsnorm_reference(x, weight, EPS)) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_norm_without_a_weight_is_x_over_its_rms(dtype):
    gen = generator(9)
    x = randn(*SHAPES[1], dtype=dtype, gen=gen) * 4
    out = diffulex_kernels.rmsnorm(x, None, EPS, out=poisoned_like(x))
    assert relative_error(out, rmsnorm_reference(x, torch.ones(x.shape[1], device=x.device), EPS)) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rmsnorm_matches_add_then_norm(shape, dtype):
    gen = generator(shape[0] + shape[1])
    x = randn(*shape, dtype=dtype, gen=gen)
    residual = randn(*shape, dtype=dtype, gen=gen) * 3
    weight = randn(shape[1], dtype=dtype, gen=gen)
    expected_residual = x + residual
    normed, new_residual = diffulex_kernels.fused_add_rmsnorm(
        x, residual, weight, EPS, out=poisoned_like(x), residual_out=poisoned_like(x)
    )
    # The residual stream is carried exactly as the unfused add would carry it.
    assert_equal_after_rounding(new_residual, expected_residual)
    assert relative_error(normed, rmsnorm_reference(expected_residual, weight, EPS)) < REL_TOL[dtype]


def test_a_strided_view_is_normed_without_a_copy():
    # The engine norms slices of a wider buffer (e.g. the first half of a fused projection).
    gen = generator(2)
    tokens, hidden = SHAPES[1]
    wide = randn(tokens, 2 * hidden, dtype=torch.bfloat16, gen=gen)
    weight = randn(hidden, dtype=torch.bfloat16, gen=gen)
    x = wide[:, :hidden]
    out = diffulex_kernels.rmsnorm(x, weight, EPS, out=poisoned_like(x))
    assert relative_error(out, rmsnorm_reference(x, weight, EPS)) < REL_TOL[torch.bfloat16]


def test_residual_can_be_updated_in_place():
    gen = generator(4)
    x = randn(*SHAPES[0], dtype=torch.bfloat16, gen=gen)
    residual = randn(*SHAPES[0], dtype=torch.bfloat16, gen=gen)
    weight = randn(SHAPES[0][1], dtype=torch.bfloat16, gen=gen)
    expected_residual = x + residual
    normed, new_residual = diffulex_kernels.fused_add_rmsnorm(x, residual, weight, EPS, residual_out=residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert_equal_after_rounding(residual, expected_residual)
    assert relative_error(normed, rmsnorm_reference(expected_residual, weight, EPS)) < REL_TOL[torch.bfloat16]
