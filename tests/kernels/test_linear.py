"""The weight-streaming matmul equals x @ w.T (+ bias), whole, as split-K partial sums, or with SiLU-and-mul in its
epilogue; and the residual-add RMSNorm that consumes the partial sums equals the one fed the whole product."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import diffulex_kernels
from diffulex_kernels.activation import silu_and_mul
from diffulex_kernels.linear import BLOCK_K, MAX_TOKENS, choose_split_k, linear, linear_partials, linear_silu_and_mul
from kernel_cases import DEVICE, FULL_SHAPES, generator, randn, relative_error

# (tokens, out features, in features): LLaDA-8B's and Dream-7B's projections at one block, or small shapes with
# ragged row tiles and a K that is not a multiple of the K tile.
SHAPES = ([(32, 12288, 4096), (32, 4096, 4096), (64, 4096, 12288), (32, 3584, 18944), (17, 4608, 3584)]
          if FULL_SHAPES else [(1, 64, 128), (5, 100, 200), (32, 96, 1024), (64, 70, 384)])
# The product is rounded once to the output dtype; its float32 accumulation differs from float64 far below that.
REL_TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}


def reference(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_matches_the_product(shape, dtype):
    m, n, k = shape
    gen = generator(m + n + k)
    x, weight, bias = randn(m, k, dtype=dtype, gen=gen), randn(n, k, dtype=dtype, gen=gen), randn(n, dtype=dtype, gen=gen)
    out = linear(x, weight, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    tolerance = REL_TOL[dtype] if dtype == torch.bfloat16 or x.device.type == "cpu" else 2e-3  # tf32 on a GPU
    assert relative_error(out, reference(x, weight, bias)) < tolerance


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_partial_sums_add_up_to_the_product(shape):
    m, n, k = shape
    gen = generator(7 * m + n)
    x, weight = randn(m, k, dtype=torch.bfloat16, gen=gen), randn(n, k, dtype=torch.bfloat16, gen=gen)
    partials = linear_partials(x, weight)
    assert partials.shape == (choose_split_k(n, k), m, n) and partials.dtype == torch.float32
    # Each partial is a float32 sum of exact bf16 products: the total is close to float64 far below bf16 rounding.
    assert relative_error(partials.sum(0), reference(x, weight)) < 1e-5


# (tokens, intermediate size, hidden): LLaDA-8B's and Dream-7B's gate_up at one block, or small shapes whose
# intermediate size leaves a ragged row tile.
GATED_SHAPES = ([(32, 12288, 4096), (32, 18944, 3584), (64, 12288, 4096)] if FULL_SHAPES
                else [(1, 64, 128), (5, 100, 200), (64, 70, 384)])


@pytest.mark.parametrize("shape", GATED_SHAPES, ids=str)
def test_gated_projection_equals_silu_and_mul_of_the_product(shape):
    m, inter, k = shape
    gen = generator(m + inter)
    x, gate_up = randn(m, k, dtype=torch.bfloat16, gen=gen), randn(2 * inter, k, dtype=torch.bfloat16, gen=gen)
    out = linear_silu_and_mul(x, gate_up)
    assert out.shape == (m, inter) and out.dtype == torch.bfloat16
    # Rounded where the two launches round: the same bits.
    assert torch.equal(out, silu_and_mul(linear(x, gate_up)))
    product = reference(x, gate_up)
    assert relative_error(out, F.silu(product[:, :inter]) * product[:, inter:]) < 2e-2


def test_gated_projection_past_the_kernel_goes_to_the_library_matmul():
    gen = generator(4)
    x, gate_up = randn(MAX_TOKENS + 1, 64, dtype=torch.bfloat16, gen=gen), randn(64, 64, dtype=torch.bfloat16, gen=gen)
    assert torch.equal(linear_silu_and_mul(x, gate_up), silu_and_mul(F.linear(x, gate_up)))


def test_split_k_gives_every_multiprocessor_a_program():
    assert choose_split_k(12288, 4096) == 1  # LLaDA qkv: 192 row tiles already
    assert choose_split_k(4096, 4096) == 2  # LLaDA o_proj: 64 row tiles
    assert choose_split_k(3584, 18944) == 4  # Dream down_proj: 56 row tiles
    assert choose_split_k(64, 1024) == 8  # one row tile: as many slices as K allows...
    assert choose_split_k(64, 2 * BLOCK_K) == 2
    assert choose_split_k(64, BLOCK_K) == 1  # ...and none of under one tile


def test_more_tokens_than_the_kernel_serves_go_to_the_library_matmul():
    gen = generator(3)
    x, weight = randn(MAX_TOKENS + 1, 64, dtype=torch.float32, gen=gen), randn(32, 64, dtype=torch.float32, gen=gen)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert torch.equal(linear_partials(x, weight), F.linear(x, weight)[None])


def test_residual_norm_over_partials_equals_it_over_the_whole_product():
    m, n, k = (6, 96, 1024)
    gen = generator(5)
    x, weight = randn(m, k, dtype=torch.bfloat16, gen=gen), randn(n, k, dtype=torch.bfloat16, gen=gen)
    residual, norm_weight = randn(m, n, dtype=torch.bfloat16, gen=gen), randn(n, dtype=torch.bfloat16, gen=gen)
    partials = linear_partials(x, weight)
    assert partials.shape[0] > 1
    whole = partials.sum(0).to(torch.bfloat16)  # the product as an unsplit matmul would round it
    expected_normed, expected_residual = diffulex_kernels.fused_add_rmsnorm(whole, residual, norm_weight, 1e-5)
    normed, new_residual = diffulex_kernels.fused_add_rmsnorm(partials, residual, norm_weight, 1e-5)
    # The kernel adds the partials in torch's order, so where it is compiled the residual is the same bit for bit.
    # The interpreter truncates at each of its two roundings instead (kernel_cases.py).
    if DEVICE.type == "cuda":
        assert torch.equal(new_residual, expected_residual)
    assert relative_error(new_residual, expected_residual) < 8e-3
    assert relative_error(normed, expected_normed) < 8e-3
