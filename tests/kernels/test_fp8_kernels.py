"""The FP8 kernels against their torch references: the Triton fp8 product (per-row and block scales, bias, ragged
shapes), the per-token activation cast, cuBLASLt's product, the W8A8 linear as a whole, and the fused MoE with fp8
expert stacks.

Under TRITON_INTERPRET=1 (CPU) Triton 3.6's interpreter casts float32 to float8e4nv without carrying a mantissa
round-up into the exponent (127.6 becomes 64, not 128) and rounds ties away from zero (84 becomes 88, not 80), so
the activation cast's fp8 values are checked there within e4m3's rounding where no carry happens, and bit for bit
on the GPU; its scales, and the products fed with torch-cast fp8
inputs, are checked everywhere."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from diffulex_backend.layers.fp8_linear import dequantize_weight, quantize_weight
from diffulex_backend.layers.moe import experts_reference, with_shared_choices
from diffulex_kernels.fp8 import (
    FP8, MIN_PROGRAMS, Tiles, choose_tiles, fp8_linear, fp8_matmul, fp8_matmul_partials, fp8_rows_linear,
    fp8_rows_partials, fp8_silu_and_mul, pipeline_bytes, quantize_rows, quantize_rows_reference, scaled_mm,
)
from diffulex_kernels.activation import silu_and_mul, silu_and_mul_fp8
from diffulex_kernels.moe import (
    SILU, MoeLaunch, SharedExperts, down_and_combine, fused_moe, fused_moe_reference, gate_up_act, plan_moe_launch,
    route_to_tiles,
)
from diffulex_kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_fp8, norm_warps, rmsnorm, rmsnorm_fp8
from kernel_cases import DEVICE, FULL_SHAPES, generator, randn, relative_error

pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter's float8 cast is wrong at binade "
                                                            "carries (module note); cuBLASLt needs a GPU")

# The fp8 products' sums: float32 under the interpreter; on Hopper the tensor cores add each instruction's 32
# products at reduced precision (about 14 bits) before the float32 accumulator takes them (kernels/fp8.py).
FP8_SUM_TOLERANCE = 1e-5 if DEVICE.type == "cpu" else 2**-12

# (rows, K, N): LLaDA-8B's qkv/o, gate_up and down at one block (32 rows) and at 32 blocks, or small ragged ones.
SHAPES = ([(32, 4096, 12288), (32, 4096, 24576), (32, 12288, 4096), (1024, 4096, 4096), (1024, 12288, 4096)]
          if FULL_SHAPES else [(5, 64, 48), (16, 256, 96), (70, 128, 32)])


def reference_product(x_q, x_scale, w_q, w_scale, bias=None) -> torch.Tensor:
    """The product of the dequantized operands in float64."""
    x = x_q.double() * x_scale.double()[:, None]
    out = x @ dequantize_weight(w_q, w_scale).double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_matmul_equals_the_product_of_its_dequantized_operands(shape, groups):
    m, k, n = shape
    gen = generator(0)
    x_q, x_scale = quantize_rows_reference(randn(m, k, dtype=torch.float32, gen=gen))
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5, groups)
    bias = randn(n, dtype=torch.float32, gen=gen)
    out = fp8_matmul(x_q, x_scale, w_q, w_scale, bias, out_dtype=torch.float32)
    # Products of fp8 values are exact in float32; only the sums and the two scalings round.
    assert relative_error(out, reference_product(x_q, x_scale, w_q, w_scale, bias)) < FP8_SUM_TOLERANCE


@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_weight_only_fp8_matmul_equals_the_float_product_with_dequantized_weights(shape, groups):
    m, k, n = shape
    gen = generator(6)
    x = randn(m, k, dtype=torch.bfloat16, gen=gen)
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5, groups)
    bias = randn(n, dtype=torch.float32, gen=gen)
    out = fp8_matmul(x, None, w_q, w_scale, bias, out_dtype=torch.float32)
    want = x.double() @ dequantize_weight(w_q, w_scale).double().T + bias.double()
    # fp8 values are exact in bf16, so the products are exact; only the float32 sums and the scaling round.
    assert relative_error(out, want) < 1e-5


# (rows, K, N, tiles): K split 2 to 8 ways, a slice that ends past K (448 columns in 8 slices of 64: the last holds
# none), and M past one row tile. Block scales cover GROUP_COLUMNS columns, no fewer than a K tile.
SPLIT_CASES = ([(32, 4096, 4096, Tiles(64, 128, 2, 4, 5)), (32, 12288, 4096, Tiles(64, 128, 4, 4, 5)),
                (64, 4096, 1024, Tiles(64, 128, 8, 4, 4))]
               if FULL_SHAPES else [(5, 256, 48, Tiles(32, 64, 2, 4, 2)), (16, 448, 96, Tiles(64, 64, 8, 4, 2)),
                                    (70, 512, 40, Tiles(32, 64, 4, 4, 2))])
GROUP_COLUMNS = 128 if FULL_SHAPES else 64


@pytest.mark.parametrize("scaled", ["per-channel", "block"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_fp8_matmul_partials_over_k_slices_sum_to_the_product(case, scaled):
    """Every slice's partial product is written (none is NaN, none left unset), and the slices sum to the product of
    the dequantized operands; the split the tiles ask for is the split returned."""
    m, k, n, tiles = case
    groups = 1 if scaled == "per-channel" else k // GROUP_COLUMNS
    gen = generator(11)
    x_q, x_scale = quantize_rows_reference(randn(m, k, dtype=torch.float32, gen=gen))
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5, groups)
    partials = fp8_matmul_partials(x_q, x_scale, w_q, w_scale, tiles)
    assert partials.shape == (tiles.split_k, m, n) and partials.dtype == torch.float32
    assert not partials.isnan().any()
    assert relative_error(partials.sum(0), reference_product(x_q, x_scale, w_q, w_scale)) < FP8_SUM_TOLERANCE
    # fp8_matmul with the same tiles is the one sum, with the bias once.
    bias = randn(n, dtype=torch.float32, gen=gen)
    out = fp8_matmul(x_q, x_scale, w_q, w_scale, bias, torch.float32, tiles)
    assert relative_error(out, reference_product(x_q, x_scale, w_q, w_scale, bias)) < FP8_SUM_TOLERANCE


@pytest.mark.parametrize("partials", [False, True], ids=["product", "split-k"])
def test_a_row_s_product_does_not_depend_on_the_rows_padded_beside_it(partials):
    """A CUDA graph pads a step's rows to its bucket, with garbage (NaN included) in the padding: the real rows'
    products are the same bits at every padded row count up to 64, one row tile, where the split of K depends on
    the weight alone (past 64 rows more row tiles take fewer slices: kernels/fp8.py's choose_tiles)."""
    n, k = (4096, 4096) if FULL_SHAPES else (96, 256)
    gen = generator(14)
    if DEVICE.type == "cuda":
        x = randn(64, k, dtype=torch.float32, gen=gen)
        w = randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5
    else:
        # Under the interpreter tl.dot is numpy's float32 matmul, whose rows come out in other bits at other row
        # counts on some BLAS builds (AVX2 OpenBLAS among them): operands whose sums are exact in float32 leave no
        # order to tell apart, and the padding's NaN still has to stay out of the real rows.
        x, w = exact_sum_operands(64, n, k, gen)
    w_q, w_scale = quantize_weight(w)

    def first_rows(m: int) -> torch.Tensor:
        padded = x[:m].clone()
        padded[5:] = float("nan")
        x_q, x_scale = quantize_rows(padded)
        if partials:
            out = fp8_rows_partials(x_q, x_scale, w_q, w_scale, torch.float32)[:, :5]
            return out.sum(0) if out.shape[0] > 1 else out[0]  # in slice order, as the norm adds them
        return fp8_matmul(x_q, x_scale, w_q, w_scale, None, torch.float32)[:5]

    alone = first_rows(5)
    for m in (8, 16, 17, 32, 33, 64):
        assert torch.equal(first_rows(m), alone), f"{m} rows"


def exact_sum_operands(m: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] and w [n, k] of integers up to 16 in magnitude, e4m3 values, with each row's largest value 448 in a
    column of its own (x's first, w's second): each row casts to fp8 with a scale of exactly 1, and every product's
    sum, in any order and any split of k, is an integer under 2**24, exact in float32."""
    x = torch.randint(-16, 17, (m, k), generator=gen, device=DEVICE).float()
    w = torch.randint(-16, 17, (n, k), generator=gen, device=DEVICE).float()
    x[:, 0], w[:, 1] = 448.0, 448.0
    return x, w


def test_a_slice_past_k_reads_no_block_scale_past_the_weights():
    """K = 3 column groups in two slices of two tiles: the second slice's last tile lies past K, and the scale it
    would read for the last weight row lies past the scale tensor. NaN there must not reach the product."""
    m, n, groups = 3, 40, 3
    k = groups * GROUP_COLUMNS
    gen = generator(13)
    x_q, x_scale = quantize_rows_reference(randn(m, k, dtype=torch.float32, gen=gen))
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5, groups)
    memory = torch.full((n * groups + 64,), float("nan"), device=DEVICE)
    memory[: n * groups] = w_scale.reshape(-1)
    followed_by_nan = memory[: n * groups].view(n, groups)
    tiles = Tiles(32, GROUP_COLUMNS, 2, 4, 2)
    partials = fp8_matmul_partials(x_q, x_scale, w_q, followed_by_nan, tiles)
    assert not partials.isnan().any()
    assert relative_error(partials.sum(0), reference_product(x_q, x_scale, w_q, w_scale)) < FP8_SUM_TOLERANCE


def test_fp8_rows_partials_split_k_where_the_row_tiles_leave_the_gpu_idle():
    """o_proj's shape at a block's rows: too few row tiles for the multiprocessors, so the product comes as partials."""
    m, k, n = (32, 4096, 4096) if FULL_SHAPES else (5, 1024, 64)
    gen = generator(12)
    x_q, x_scale = quantize_rows_reference(randn(m, k, dtype=torch.float32, gen=gen))
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5)
    partials = fp8_rows_partials(x_q, x_scale, w_q, w_scale, torch.bfloat16)
    assert partials.shape[0] == choose_tiles(m, n, k).split_k > 1
    assert relative_error(partials.sum(0), reference_product(x_q, x_scale, w_q, w_scale)) < FP8_SUM_TOLERANCE


def test_choose_tiles_fills_the_gpu_and_fits_shared_memory():
    # LLaDA-8B's projections at one block: split until about two programs a multiprocessor.
    assert choose_tiles(32, 4096, 4096) == Tiles(64, 128, 4, 4, 4)  # o_proj: 64 row tiles
    assert choose_tiles(32, 4096, 12288).split_k == 4  # down_proj
    assert choose_tiles(32, 12288, 4096).split_k == 2  # qkv: 192 row tiles
    assert choose_tiles(32, 24576, 4096).split_k == 1  # gate_up: 384 row tiles already
    assert choose_tiles(32, 64, 128).split_k == 1  # never a slice under one K tile
    for m in (1, 16, 32, 64, 200):
        tiles = choose_tiles(m, 4096, 4096)
        programs = (4096 // tiles.block_n) * tiles.split_k * -(-m // 64)
        assert programs >= MIN_PROGRAMS or tiles.split_k == 8
        for weight_only in (False, True):  # the same cut serves both
            # What an H100 gives a program (227 KB), less room for the epilogue.
            assert pipeline_bytes(tiles, m, weight_only) <= 180 * 1024
    # A block-scaled weight's K tile stays inside one group of columns.
    assert choose_tiles(32, 4096, 4096, groups=64).block_k == 64


def test_fp8_matmul_scales_each_column_group_by_its_own_block_scale():
    """Block scales that differ by 2^10 between column groups: a kernel that took one scale a row would be off by
    far more than rounding."""
    gen = generator(1)
    m, k, n = 8, 256, 64
    x_q, x_scale = quantize_rows_reference(randn(m, k, dtype=torch.float32, gen=gen))
    w = randn(n, k, dtype=torch.float32, gen=gen)
    w[:, 128:] *= 1024
    w_q, w_scale = quantize_weight(w, groups=2)
    assert (w_scale[:, 1] > 100 * w_scale[:, 0]).all()
    out = fp8_matmul(x_q, x_scale, w_q, w_scale, out_dtype=torch.float32)
    assert relative_error(out, reference_product(x_q, x_scale, w_q, w_scale)) < FP8_SUM_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_rows_gives_the_reference_scale_per_token(shape):
    m, k, _ = shape
    x = randn(m, k, dtype=torch.bfloat16, gen=generator(2))
    x[0] = 0  # an all-zero row takes the smallest scale and casts to zeros
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_reference(x)
    assert torch.equal(scale, want_scale)
    if DEVICE.type == "cuda":
        assert torch.equal(q.float(), want_q.float())
    else:
        # Where rounding carries into the next power of two the interpreter's cast is wrong, and it rounds ties
        # away from zero rather than to even (module note): elsewhere each value is x times 1 / scale rounded to e4m3,
        # within half a unit in its last place (2^-4 relative, 2^-10 among the subnormals).
        exact = x.float() * (1 / want_scale[:, None])
        carry = torch.frexp(want_q.float())[1] != torch.frexp(exact)[1]
        assert carry.float().mean() < 0.05  # the comparison still covers nearly every element
        error = (q.float() - exact).abs()[~carry]
        assert (error <= exact.abs()[~carry] * 2**-4 + 2**-10).all()
    assert (q[0].float() == 0).all()


@gpu_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaled_mm_equals_the_product_of_its_dequantized_operands(shape):
    m, k, n = shape
    gen = generator(3)
    x_q, x_scale = quantize_rows_reference(randn(m, k, dtype=torch.float32, gen=gen))
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5)
    out = scaled_mm(x_q, x_scale, w_q, w_scale)
    # cuBLASLt writes row-wise scaled products in bf16: half a unit in its last place is 2^-9 of each element.
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference_product(x_q, x_scale, w_q, w_scale)) < 2**-8


@gpu_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_linear_is_within_activation_rounding_of_the_weight_only_reference(shape):
    """W8A8 against the CPU path's weight-only product (dequantized weights, float activations). Each e4m3
    activation is within 2^-4 of itself; with random signs the product's relative error is about the rms of that
    rounding, 2^-4 / sqrt(3) = 3.6%, so 2^-4 bounds it with the bf16 output's rounding on top."""
    m, k, n = shape
    gen = generator(4)
    x = randn(m, k, dtype=torch.bfloat16, gen=gen)
    w_q, w_scale = quantize_weight(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5)
    out = fp8_linear(x, w_q, w_scale)
    want = x.double() @ dequantize_weight(w_q, w_scale).double().T
    assert out.dtype == torch.bfloat16 and relative_error(out, want) < 2**-4
    # And exactly the product of the reference cast, up to the float32 sums and the bf16 output.
    x_q, x_scale = quantize_rows_reference(x)
    assert relative_error(out, reference_product(x_q, x_scale, w_q, w_scale)) < 8e-3


def fp8_experts(groups: int, gen: torch.Generator, group_gain: float = 1.0):
    """(x, gate_up, gate_up_scale, down, down_scale, ids, weights) at Qwen3-30B-A3B's expert shape (six groups of
    128 act columns), or a small one whose second group is ragged (160 columns). With `group_gain` each group of
    128 act columns is that many times larger than the one before, so a scale taken from another group shows."""
    experts, hidden, inter = (128, 2048, 768) if FULL_SHAPES else (4, 64, 160)
    tokens, top_k = (32, 8) if FULL_SHAPES else (7, 2)
    x = randn(tokens, hidden, dtype=torch.float32, gen=gen)
    gate_up = randn(experts, 2 * inter, hidden, dtype=torch.float32, gen=gen) * hidden**-0.5
    gain = group_gain ** (torch.arange(inter, device=DEVICE) // 128).float()
    gate_up[:, inter:] *= gain[:, None]  # the up rows of each act group
    # groups 1: a scale per row; else block scales of 128 columns (32 in the small shape), as released.
    group_k = 128 if FULL_SHAPES else 32
    gate_up, gate_up_scale = quantize_weight(gate_up, 1 if groups == 1 else hidden // group_k)
    down, down_scale = quantize_weight(randn(experts, hidden, inter, dtype=torch.float32, gen=gen) * inter**-0.5,
                                       1 if groups == 1 else inter // group_k)
    values, ids = torch.randn(tokens, experts, generator=gen, device=DEVICE).topk(top_k, dim=1)
    return x, gate_up, gate_up_scale, down, down_scale, ids, torch.softmax(values, dim=1)


@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
def test_weight_only_fused_moe_equals_the_dequantized_reference(groups):
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(groups, generator(5))
    out = fused_moe(x, gate_up, down, ids, weights, w_gate_up_scale=gate_up_scale, w_down_scale=down_scale,
                    weight_only=True)
    want = experts_reference(x.double(), gate_up, down, ids, weights.double(), gate_up_scale, down_scale)
    # float32 on the GPU runs the products in tf32.
    assert relative_error(out, want) < (2e-3 if DEVICE.type == "cuda" else 1e-5)
    assert gate_up.dtype == FP8


def fp8_shared_experts(groups: int, gen: torch.Generator, hidden: int, inter: int, count: int) -> SharedExperts:
    """A shared MLP of count experts' columns, quantized as fp8_experts quantizes the stacks."""
    group_k = 128 if FULL_SHAPES else 32
    gate_up, gate_up_scale = quantize_weight(
        randn(2 * count * inter, hidden, dtype=torch.float32, gen=gen) * hidden**-0.5,
        1 if groups == 1 else hidden // group_k)
    down, down_scale = quantize_weight(
        randn(hidden, count * inter, dtype=torch.float32, gen=gen) * (count * inter)**-0.5,
        1 if groups == 1 else count * inter // group_k)
    return SharedExperts(gate_up, down, gate_up_scale, down_scale)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
def test_fp8_shared_experts_among_the_routed_ones_add_their_dequantized_mlp(groups, count):
    """Shared experts with fp8 weights and their scales, per row or in blocks of columns, run among the routed
    experts (weight-only here, which the interpreter runs exactly): the routed sum plus the dequantized shared MLP."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(groups, generator(11))
    num_experts, hidden, inter = down.shape
    shared = fp8_shared_experts(groups, generator(12), hidden, inter, count)
    all_ids, all_weights = with_shared_choices(ids, weights, num_experts, count)
    out = fused_moe(x, gate_up, down, all_ids, all_weights, w_gate_up_scale=gate_up_scale, w_down_scale=down_scale,
                    weight_only=True, shared_experts=shared)
    gate_up_weight = dequantize_weight(shared.w_gate_up, shared.w_gate_up_scale).double()
    mlp_gate, mlp_up = (x.double() @ gate_up_weight.T).chunk(2, -1)
    mlp = (F.silu(mlp_gate) * mlp_up) @ dequantize_weight(shared.w_down, shared.w_down_scale).double().T
    want = experts_reference(x.double(), gate_up, down, ids, weights.double(), gate_up_scale, down_scale) + mlp
    assert relative_error(out, want) < (2e-3 if DEVICE.type == "cuda" else 1e-5)
    assert relative_error(out, want - mlp) > 1e-2


@gpu_only
@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
def test_fp8_shared_experts_take_the_w8a8_products_of_the_routed_ones(groups):
    """W8A8 (the tokens and act rows cast as the routed experts' are): fused_moe_reference's W8A8 way with the
    shared experts, and within the casts' rounding of the weight-only layer."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(groups, generator(13))
    num_experts, hidden, inter = down.shape
    shared = fp8_shared_experts(groups, generator(14), hidden, inter, 1)
    ids, weights = with_shared_choices(ids, weights, num_experts, 1)
    x = x.to(torch.bfloat16)
    scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale, shared_experts=shared)
    out = fused_moe(x, gate_up, down, ids, weights, **scales)
    group = plan_moe_launch(ids.numel(), num_experts + 1, element_size=1).block_n
    assert relative_error(out, fused_moe_reference(x, gate_up, down, ids, weights, act_group=group, **scales)) < 1e-2
    assert relative_error(out, fused_moe(x, gate_up, down, ids, weights, weight_only=True, **scales)) < 2**-4


# The engine's fp8 plan (act groups of 128 columns, K tiles of 128), and a narrower one whose act groups (64) are
# narrower than its K tile (128), which the down product must then cut to stay in one group.
FP8_LAUNCHES = {"plan": None, "n64-k128": MoeLaunch(16, 64, 128, 4, 4)}


@pytest.mark.parametrize("launch_name", FP8_LAUNCHES)
@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
def test_fp8_experts_write_act_rows_cast_with_a_scale_per_row_and_group_of_columns(groups, launch_name):
    """gate_up's fp8 product over torch-cast tokens, and the act rows it writes: each group of block_n columns (a
    column tile) scaled by its own largest magnitude, 128-column blocks 16 times apart in size."""
    x, gate_up, gate_up_scale, *_, ids, _ = fp8_experts(groups, generator(6), group_gain=16.0)
    x_q, x_scale = quantize_rows_reference(x)
    launch = FP8_LAUNCHES[launch_name] or plan_moe_launch(ids.numel(), gate_up.shape[0], element_size=1)
    routed = route_to_tiles(ids, gate_up.shape[0], launch.block_m)
    act_q, act_scale = gate_up_act(x_q, gate_up, routed, ids.shape[1], launch, gate_up_scale, SILU, x_scale,
                                   torch.float32)
    inter = gate_up.shape[1] // 2
    assert act_q.dtype == FP8 and act_scale.shape == (act_q.shape[0], -(-inter // launch.block_n))
    pairs = routed.pair_ids.long()
    rows = pairs < ids.numel()
    pairs = pairs[rows]
    products = x_q.double()[pairs // ids.shape[1]] * x_scale.double()[pairs // ids.shape[1], None]
    products = torch.stack([p @ dequantize_weight(gate_up[e], gate_up_scale[e]).double().T
                            for p, e in zip(products, ids.reshape(-1)[pairs].tolist())])
    act = F.silu(products[:, :inter]) * products[:, inter:]  # [pairs, I], float64
    groups_of_act = F.pad(act, (0, act_scale.shape[1] * launch.block_n - inter)).unflatten(1, (-1, launch.block_n))
    want_scale = groups_of_act.abs().amax(-1) / 448
    assert relative_error(act_scale[rows], want_scale) < FP8_SUM_TOLERANCE
    exact = act / act_scale[rows].double().repeat_interleave(launch.block_n, 1)[:, :inter]
    got = act_q[rows].double()
    # Each value is its quotient rounded to e4m3: within half a unit in its last place, 2^-4 relative (2^-10 among
    # the subnormals). The kernel's quotient is off the exact one by its sums' error, FP8_SUM_TOLERANCE of the
    # group's largest value (448 in these units; Hopper adds fp8 products at reduced precision).
    bound = exact.abs() * 2**-4 + 2**-10 + 448 * FP8_SUM_TOLERANCE
    if DEVICE.type == "cuda":
        assert ((got - exact).abs() <= bound).all()
    else:  # the interpreter's cast is wrong where rounding carries into the exponent (module note)
        carry = torch.frexp(exact.float().clamp(-448, 448).to(FP8).double())[1] != torch.frexp(exact)[1]
        assert carry.float().mean() < 0.05
        assert ((got - exact).abs() <= bound)[~carry].all()


@pytest.mark.parametrize("launch_name", FP8_LAUNCHES)
@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
def test_fp8_experts_scale_each_k_tile_of_the_down_product_by_its_act_group(groups, launch_name):
    """The down product of fp8 act rows made by torch's cast, block_n columns a scale, groups 16 times apart."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(groups, generator(7))
    num_experts, hidden, inter = down.shape
    launch = FP8_LAUNCHES[launch_name] or plan_moe_launch(ids.numel(), num_experts, element_size=1)
    routed = route_to_tiles(ids, num_experts, launch.block_m)
    rows = routed.pair_ids.numel()
    gain = 16.0 ** (torch.arange(inter, device=DEVICE) // launch.block_n).float()
    act = randn(rows, inter, dtype=torch.float32, gen=generator(8)) * gain
    padded = F.pad(act, (0, -inter % launch.block_n)).reshape(-1, launch.block_n)
    act_q, act_scale = quantize_rows_reference(padded)
    act_q = act_q.reshape(rows, -1)[:, :inter].contiguous()
    act_scale = act_scale.reshape(rows, -1)
    out = down_and_combine(act_q, down, weights, routed, x.shape[0], launch, down_scale, act_scale, torch.float32)
    dequantized = act_q.double() * act_scale.double().repeat_interleave(launch.block_n, 1)[:, :inter]
    want = torch.zeros(x.shape, dtype=torch.float64, device=DEVICE)
    for row, pair in enumerate(routed.pair_ids.tolist()):
        if pair < ids.numel():
            token, expert = pair // ids.shape[1], int(ids.reshape(-1)[pair])
            want[token] += float(weights.reshape(-1)[pair]) * (
                dequantize_weight(down[expert], down_scale[expert]).double() @ dequantized[row])
    assert relative_error(out, want) < FP8_SUM_TOLERANCE


def test_fp8_experts_take_tokens_already_cast_in_place_of_their_own_cast():
    """The fused forward casts a MoE layer's tokens once for the routed and the shared experts: the rows given are
    the ones multiplied (other tokens' rows here), hidden gives only the shapes and the activations' dtype."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(1, generator(10))
    x, other = x.to(torch.bfloat16), (x.flip(0) * 3).to(torch.bfloat16)
    scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)
    given = fused_moe(x, gate_up, down, ids, weights, rows=quantize_rows(other), **scales)
    assert torch.equal(given, fused_moe(other, gate_up, down, ids, weights, **scales))
    assert not torch.equal(given, fused_moe(x, gate_up, down, ids, weights, **scales))


def test_expert_launches_that_fp8_products_cannot_run_are_refused_and_weight_only_ones_narrow_their_k_tile():
    """fp8 products take K tiles of at least 32 columns: act groups (block_n) or weight scale groups narrower than
    that are refused by name. A weight-only product takes a 16-column scale group in 16-column K tiles."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(1, generator(13))
    scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)
    with pytest.raises(ValueError, match="at least 32, got 16"):
        fused_moe(x, gate_up, down, ids, weights, launch=MoeLaunch(16, 16, 128, 4, 4), **scales)
    x_q, x_scale = quantize_rows(x)
    launch = plan_moe_launch(ids.numel(), gate_up.shape[0], element_size=1)
    routed = route_to_tiles(ids, gate_up.shape[0], launch.block_m)
    with pytest.raises(ValueError, match="activations' dtype"):
        gate_up_act(x_q, gate_up, routed, ids.shape[1], launch, gate_up_scale, SILU, x_scale)
    act, act_scale = gate_up_act(x_q, gate_up, routed, ids.shape[1], launch, gate_up_scale, SILU, x_scale,
                                 torch.float32)
    with pytest.raises(ValueError, match="output's dtype"):
        down_and_combine(act, down, weights, routed, x.shape[0], launch, down_scale, act_scale)
    # Block scales over 16 columns.
    hidden, inter = gate_up.shape[2], down.shape[2]
    gate_up16, gate_up16_scale = quantize_weight(dequantize_weight(gate_up, gate_up_scale), hidden // 16)
    down16, down16_scale = quantize_weight(dequantize_weight(down, down_scale), inter // 16)
    scales16 = dict(w_gate_up_scale=gate_up16_scale, w_down_scale=down16_scale)
    with pytest.raises(ValueError, match="K tile of 16 columns .* not a power of two of at least 32"):
        fused_moe(x, gate_up16, down16, ids, weights, **scales16)
    out = fused_moe(x, gate_up16, down16, ids, weights, weight_only=True, **scales16)
    want = experts_reference(x.double(), gate_up16, down16, ids, weights.double(), gate_up16_scale, down16_scale)
    assert relative_error(out, want) < (2e-3 if DEVICE.type == "cuda" else 1e-5)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_token_of_nan_or_infinity_leaves_the_other_tokens_of_its_experts_alone(poison):
    """A CUDA graph's padding rows hold whatever was in memory, and an overflowed hidden state holds infinities: such
    a token shares expert tiles, and act groups' columns, with real tokens, whose outputs must not change. Every
    token is routed to the same two experts, so the poisoned one sits in every tile."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(1, generator(11))
    x = x.to(torch.bfloat16)
    ids = torch.tensor([[0, 1]], device=DEVICE).expand(x.shape[0], 2).contiguous()
    weights = weights[:, :2].contiguous()
    scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)
    clean = fused_moe(x, gate_up, down, ids, weights, **scales)
    poisoned = x.clone()
    poisoned[3, 5] = poison
    out = fused_moe(poisoned, gate_up, down, ids, weights, **scales)
    others = [t for t in range(x.shape[0]) if t != 3]
    assert torch.equal(out[others], clean[others])
    assert torch.isfinite(clean).all()


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
def test_fused_moe_with_fp8_stacks_is_its_w8a8_reference_and_near_the_weight_only_one(groups, dtype):
    """The whole layer against fused_moe_reference's W8A8 way (torch's casts, float products): equal up to the
    float32 sums, which now and then move an act value across an e4m3 rounding boundary. Against the weight-only
    product it is within the tokens' and act's rounding to e4m3 (2^-4 with random signs, as the dense product)."""
    x, gate_up, gate_up_scale, down, down_scale, ids, weights = fp8_experts(groups, generator(9))
    x = x.to(dtype)
    scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)
    out = fused_moe(x, gate_up, down, ids, weights, **scales)
    group = plan_moe_launch(ids.numel(), gate_up.shape[0], element_size=1).block_n
    assert relative_error(out, fused_moe_reference(x, gate_up, down, ids, weights, act_group=group, **scales)) < (
        1e-2 if dtype == torch.bfloat16 else 2e-3)
    weight_only = experts_reference(x.double(), gate_up, down, ids, weights.double(), gate_up_scale, down_scale)
    assert relative_error(out, weight_only) < 2**-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("partials", [1, 2], ids=["product", "split-k"])
@pytest.mark.parametrize("shape", [(32, 4096), (1024, 4096), (32, 3584)] if FULL_SHAPES else [(5, 96)], ids=str)
def test_norms_with_fp8_rows_give_the_cast_of_their_float_rows_bit_for_bit(dtype, partials, shape):
    """The norm that casts its rows as it writes them equals the norm, then quantize_rows: the same rounding to
    the activation dtype, the same scale, the same cast (the interpreter's included), and the same residual. The
    float norm runs at the cast norm's warps, which order its sums: more of them below 128 rows (LLaDA-8B's and
    Dream-7B's widths at a block's rows), as many at 1024."""
    tokens, hidden = shape
    warps = norm_warps(hidden, fp8_out=True, num_rows=tokens)
    gen = generator(7)
    x = randn(partials, tokens, hidden, dtype=torch.float32 if partials > 1 else dtype, gen=gen)
    x = x if partials > 1 else x[0]
    residual = randn(tokens, hidden, dtype=dtype, gen=gen)
    weight = randn(hidden, dtype=dtype, gen=gen)
    (q, scale), residual_out = fused_add_rmsnorm_fp8(x, residual, weight, 1e-6)
    want_rows, want_residual = fused_add_rmsnorm(x, residual, weight, 1e-6, num_warps=warps)
    want_q, want_scale = quantize_rows(want_rows)
    assert torch.equal(residual_out, want_residual) and torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    q, scale = rmsnorm_fp8(residual, weight, 1e-6)
    want_q, want_scale = quantize_rows(rmsnorm(residual, weight, 1e-6, num_warps=warps))
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(32, 12288), (1024, 18944)] if FULL_SHAPES else [(5, 80), (6, 2500)], ids=str)
def test_silu_and_mul_with_fp8_rows_gives_the_cast_of_its_float_rows_bit_for_bit(dtype, shape):
    """A row spread over chunks of 1024 columns, the last one ragged, gets the scale of its largest value wherever
    that lies."""
    tokens, inter = shape
    gate_up = randn(tokens, 2 * inter, dtype=dtype, gen=generator(8))
    q, scale = silu_and_mul_fp8(gate_up)
    want_q, want_scale = quantize_rows(silu_and_mul(gate_up))
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# (rows, K, I): LLaDA-8B's gate_up at one block, and at 32 blocks (cuBLASLt's product and the two-launch
# SiLU-and-mul, on a GPU), or small ragged ones (I not a multiple of a program's 32 columns).
GATED_SHAPES = [(32, 4096, 12288), (1024, 4096, 12288)] if FULL_SHAPES else [(5, 256, 48), (16, 128, 96), (70, 128, 40)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("groups", [1, 2], ids=["per-channel", "block"])
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=str)
def test_silu_and_mul_in_the_gate_up_product_s_epilogue_is_the_unfused_one_bit_for_bit(shape, groups, dtype):
    """fp8_silu_and_mul (the product with SiLU-and-mul in its epilogue, then the cast of its rows) gives the values
    and scales of the product followed by the two-launch SiLU-and-mul, bit for bit: each program rounds its gate and
    up to the activations' dtype as the product would write them, and a row's scale comes from the largest of its
    programs' magnitudes, which does not depend on how the row is cut."""
    m, k, inter = shape
    gen = generator(12)
    x_q, x_scale = quantize_rows(randn(m, k, dtype=dtype, gen=gen))
    w_q, w_scale = quantize_weight(randn(2 * inter, k, dtype=torch.float32, gen=gen) * k**-0.5, groups)
    q, scale = fp8_silu_and_mul(x_q, x_scale, w_q, w_scale, dtype)
    want_q, want_scale = silu_and_mul_fp8(fp8_rows_linear(x_q, x_scale, w_q, w_scale, None, dtype))
    assert q.shape == (m, inter) and q.dtype == FP8
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_a_gate_up_with_a_bias_takes_the_product_then_the_two_launch_silu_and_mul():
    gen = generator(14)
    x_q, x_scale = quantize_rows(randn(5, 64, dtype=torch.bfloat16, gen=gen))
    w_q, w_scale = quantize_weight(randn(96, 64, dtype=torch.float32, gen=gen) * 0.125)
    bias = randn(96, dtype=torch.bfloat16, gen=gen)
    q, scale = fp8_silu_and_mul(x_q, x_scale, w_q, w_scale, torch.bfloat16, bias)
    want_q, want_scale = silu_and_mul_fp8(fp8_rows_linear(x_q, x_scale, w_q, w_scale, bias, torch.bfloat16))
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_a_gated_product_of_odd_rows_is_refused():
    gen = generator(13)
    x_q, x_scale = quantize_rows(randn(4, 64, dtype=torch.bfloat16, gen=gen))
    w_q, w_scale = quantize_weight(randn(33, 64, dtype=torch.float32, gen=gen))
    with pytest.raises(ValueError, match=r"fp8_matmul: a gated product takes gate and up rows alike \(33 rows\)"):
        fp8_silu_and_mul(x_q, x_scale, w_q, w_scale, torch.bfloat16)


def assert_cast_like_torch(q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> None:
    """The scales torch's cast of `rows` (quantize_rows_reference) gives, and on the GPU its values: NaN where it
    gives NaN, the same bytes elsewhere. The interpreter's float8 cast is wrong at binade carries and casts a float32
    NaN to a finite value (module note), so there the scales alone are compared."""
    want_q, want_scale = quantize_rows_reference(rows)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0, equal_nan=True)
    if DEVICE.type == "cuda":
        nan = want_q.float().isnan()
        assert torch.equal(q.float().isnan(), nan)
        assert torch.equal(q.view(torch.uint8)[~nan], want_q.view(torch.uint8)[~nan])


NON_FINITE_ROWS = {1: float("nan"), 2: float("inf"), 3: float("-inf")}  # row -> a value one of its columns holds


@pytest.mark.parametrize("writer", ["quantize_rows", "silu_and_mul_fp8", "fp8_silu_and_mul", "rmsnorm_fp8",
                                    "fused_add_rmsnorm_fp8"])
def test_a_row_holding_nan_or_infinity_casts_to_fp8_as_torch_casts_it(writer):
    """A NaN or an infinity in a row is not dropped: the row's scale and values come out as torch's cast gives
    them (a NaN row stays NaN, an infinite magnitude makes an infinite scale), never finite values at full
    magnitude. Triton's maxima drop NaN on a GPU unless told otherwise; the interpreter runs them as numpy's, so
    its run checks the scales of the row writers' arithmetic, the GPU's the compiled maxima too
    (test_fp8_cast_ir.py checks those on the CPU). The other rows are untouched by their neighbours'."""
    tokens, width = (32, 4096) if FULL_SHAPES else (5, 2500)  # more than two 1024-column chunks of the SiLU
    gen = generator(9)
    silu = writer == "silu_and_mul_fp8"
    x = randn(tokens, 2 * width if silu else width, dtype=torch.bfloat16, gen=gen)
    for row, value in NON_FINITE_ROWS.items():
        x[row, x.shape[1] - 3] = value  # in the last chunk (of the SiLU's up half)
        x[row, 3] = value  # among the columns the gate_up product reads
    weight = randn(width, dtype=torch.bfloat16, gen=gen)
    # The float norm at the cast norm's warps, which order its sums: the finite rows' scales then agree bit for bit.
    warps = norm_warps(width, fp8_out=True, num_rows=tokens)
    if writer == "quantize_rows":
        q, scale = quantize_rows(x)
        rows = x
    elif writer == "fp8_silu_and_mul":  # the product's rows of NaN or infinity, from the tokens cast before it
        x_q, x_scale = quantize_rows(x[:, :64])
        w_q, w_scale = quantize_weight(randn(2 * width, 64, dtype=torch.float32, gen=gen) * 0.125)
        q, scale = fp8_silu_and_mul(x_q, x_scale, w_q, w_scale, torch.bfloat16)
        rows = silu_and_mul(fp8_rows_linear(x_q, x_scale, w_q, w_scale, None, torch.bfloat16))
    elif silu:
        q, scale = silu_and_mul_fp8(x)
        rows = silu_and_mul(x)
    elif writer == "rmsnorm_fp8":
        q, scale = rmsnorm_fp8(x, weight, 1e-6)
        rows = rmsnorm(x, weight, 1e-6, num_warps=warps)
    else:
        residual = randn(tokens, width, dtype=torch.bfloat16, gen=gen)
        (q, scale), _ = fused_add_rmsnorm_fp8(x, residual, weight, 1e-6)
        rows, _ = fused_add_rmsnorm(x, residual, weight, 1e-6, num_warps=warps)
    assert rows[1].isnan().any() and not rows[0].isnan().any()
    assert_cast_like_torch(q, scale, rows)
    assert scale[1].isnan() and scale[0].isfinite() and scale[4].isfinite()
