"""W8A8 FP8 products: y = (x_q * x_scale) @ (w_q * w_scale).T, with float8_e4m3fn weights and activations.

- `quantize_rows` casts activations to fp8 with a scale per token (row): one program reads a row once, takes its
  absolute maximum, and writes the scale and the fp8 row in the same pass, so the cast costs one read and one
  one-byte write of the activations, not the three passes of separate amax, divide and cast ops.
- `fp8_matmul` is a Triton `tl.dot` on fp8 tiles. As in `linear.py` the weight rows sit on the wide side of the
  tensor-core product and the tokens on the narrow side, and at a decode step's few rows the kernel streams the
  weight: `choose_tiles` sizes its tiles for the bytes in flight and splits K where the row tiles are too few to
  occupy the GPU. `fp8_matmul_partials` hands the split's float32 partial sums to the residual-add norm after a
  row-parallel projection, which adds them up as it reads (norm.py), so the split costs no launch. A weight with
  one scale per row (G = 1) is scaled once, after the sum over K; block-scaled weights (G > 1, a released
  checkpoint's 128×128 blocks) scale each K tile's partial product by its group's scale.
- with `x_scale` None the same kernel is weight-only (W8A16): the activations stay in their dtype and each fp8
  weight tile is widened to it in registers, which skips the activations' cast at the price of 16-bit tensor-core
  products; benchmarks/fp8.py measures it beside W8A8 at a few rows, where the weights' bytes decide.
- `fp8_silu_and_mul` is the gated MLP's gate_up product with SiLU-and-mul in its epilogue, as `linear.py`'s
  streaming kernel has it: a program owns ACT_GROUP gate rows and the up rows that pair with them, and writes
  silu(gate) * up cast to fp8 with a scale per row and per its ACT_GROUP columns, which it holds whole. The cast
  then needs no pass over the rows of its own, and the down projection takes those rows with their scales
  (x_scale [M, groups]): each K tile lies inside one group and its product is scaled by its rows' scales of that
  group. The values are those that the product, `silu_and_mul` and a cast of each group of ACT_GROUP columns
  (`quantize_rows` over the [M * groups, ACT_GROUP] view) give one after the other.
- `scaled_mm` is cuBLASLt's FP8 product through `torch._scaled_mm`, with row-wise scales (one per token, one per
  weight row); it takes G = 1 only.
`fp8_linear`, `fp8_rows_partials` and `fp8_rows_silu_and_mul` choose: the Triton kernel up to `TRITON_MAX_ROWS`
rows, for block scales, for rows cast in groups of columns and for activations other than bf16 (cuBLASLt writes
row-wise scaled products in bf16 only), `scaled_mm` otherwise (benchmarks/fp8.py measures both at a decode step's
shapes).

The scales are float32 and every product accumulates in float32. A product is in the activations' dtype, the
Triton kernel's partial sums in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dtypes import dot_dtype, triton_dtype
from .activation import silu_and_mul_fp8
from .fp8_cast import FP8_MAX, MIN_SCALE, abs_max, cast_to_fp8_range, row_scale
from .pdl import use_pdl, wait_for_previous_kernel

FP8 = torch.float8_e4m3fn
# Rows up to which the Triton kernel runs a per-channel product, past which cuBLASLt does: a decode step's block
# of 32 rows streams the weights (the Triton kernel's shape), 1024 rows are a compute-bound GEMM.
TRITON_MAX_ROWS = 64
BLOCK_N = 64
BLOCK_K = 128
NUM_STAGES = 4
# Columns a scale of `fp8_silu_and_mul`'s rows covers: its program's gate rows (and as many up rows), so that at a
# block's rows the launch has as many programs as a product of BLOCK_N-row tiles has for one of its halves.
ACT_GROUP = BLOCK_N
# About two programs per multiprocessor of an H100 (132), before a split of K is worth its partials: with its small
# fp8 tiles each multiprocessor holds several programs, and more of them keep more loads in flight than deeper
# pipelines do (benchmarks/fp8.py's tiles section).
MIN_PROGRAMS = 256
MAX_SPLIT_K = 8
# Hopper's fp8 tensor cores add products at reduced precision (about 14 bits, DeepSeek-V3's report), and Triton lets
# them run a whole K loop that way by default: the sum is promoted to the float32 accumulator after every
# instruction's 32 products instead.
FP8_PROMOTE_EVERY = 32


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = row_scale(abs_max(x, 0))
    tl.store(q_ptr + row * stride_q + cols, cast_to_fp8_range(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M] float32) with x ≈ q * scale[:, None], one launch."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("quantize_rows: x must be [M, K] with contiguous rows")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, USE_PDL=use_pdl(x),
                                    launch_pdl=use_pdl(x), num_warps=min(16, max(4, block // 1024)))
    return q, scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in torch."""
    x = x.float()
    # A tensor divisor: torch on CUDA multiplies by the reciprocal of a scalar one, which is not the division the
    # kernel (and torch on the CPU) rounds.
    amax = x.abs().amax(-1)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Tiles(NamedTuple):
    """How `fp8_matmul` cuts a product: BLOCK_N weight rows by BLOCK_K columns a tile, K in `split_k` slices."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def row_block(m: int) -> int:
    """The kernel's row tile at m rows: 16 to 64, the tensor cores' narrow side."""
    return min(64, max(16, triton.next_power_of_2(m)))


def pipeline_bytes(tiles: Tiles, m: int, weight_only: bool = False) -> int:
    """Shared memory of a cut's pipeline at m rows: every stage holds a weight tile and a row tile (16-bit rows
    for a weight-only product)."""
    return tiles.num_stages * (tiles.block_n * tiles.block_k + tiles.block_k * row_block(m) * (2 if weight_only else 1))


def choose_tiles(m: int, n: int, k: int, groups: int = 1, x_group: int | None = None) -> Tiles:
    """The tiles of an [M, K] @ [N, K].T product.

    At a decode step's few rows the product streams the weight once, and its speed is the loads in flight. Tiles of
    64 weight rows by 128 columns, four stages deep, are small enough that a multiprocessor holds several programs
    at once, and K is split until there are about two programs per multiprocessor: on an H200 that streams LLaDA-8B's
    projections at 32 rows faster than deeper tiles (256 columns) or pipelines (five stages) do, which leave fewer
    programs on each multiprocessor (benchmarks/fp8.py's tiles section; docs/kernels.md). Four such stages take at
    most 96 KB of shared memory. A block-scaled weight's K tile stays within one scale group, and so does a K tile
    of rows cast in groups of `x_group` columns; a K tile of half the columns or fewer takes twice the stages, so
    that about as many bytes are in flight."""
    block_k = BLOCK_K if groups == 1 else min(BLOCK_K, k // groups)
    if x_group is not None:
        block_k = min(block_k, x_group)
    programs = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, row_block(m))
    split = 1
    while split < MAX_SPLIT_K and programs * split < MIN_PROGRAMS and 2 * split * block_k <= k:
        split *= 2
    return Tiles(BLOCK_N, block_k, split, 4, NUM_STAGES * min(2, BLOCK_K // block_k))


def gated_tiles(k: int, groups: int = 1) -> Tiles:
    """`fp8_silu_and_mul`'s cut: ACT_GROUP gate rows (and as many up rows) a program, the act group of the rows it
    casts, and one slice of K."""
    return choose_tiles(TRITON_MAX_ROWS, ACT_GROUP, k, groups)._replace(block_n=ACT_GROUP, split_k=1)


# M changes with every batch, and the partials' stride (M x N) with it: specialized on them, each new token count
# class would compile again.
@triton.jit(do_not_specialize=["M", "stride_os"])
def _fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, out_scale_ptr,
    M, N, K, stride_xm, stride_wn, stride_os, stride_om, GROUPS, GROUP_K, X_GROUPS, X_GROUP_K, OUT_GROUPS,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, EVEN_K: tl.constexpr,
    GROUPED: tl.constexpr, X_GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr,
    GATED: tl.constexpr, ACT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] = w_tile @ x_tile.T over this program's slice of K, written to its partial
    (out + pid_k * stride_os); GROUPED: each K tile scaled by its column group's scale (GROUP_K a multiple of
    BLOCK_K), else the row scale after the loop. X_SCALED: x is fp8 with a scale per row (W8A8), or with X_GROUPED
    one per row and group of X_GROUP_K columns, which scales each K tile (inside one group); else x is in its
    float dtype and the weight tile is widened to DOT_DTYPE in registers (W8A16). The bias goes to slice 0.
    GATED: w is [2N, K], gate rows then up rows, and the program writes silu(gate) * up rounded to ACT_DTYPE, cast
    to fp8 with a scale per row of its BLOCK_N columns (out_scale [M, OUT_GROUPS]); one slice of K only."""
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = pid_k * K_PER_SPLIT
    offs_k = k_start + tl.arange(0, SUB_K)
    n_valid = offs_n < N
    m_valid = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = w_ptrs + N * stride_wn  # GATED only
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [SUB_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k_tile in range(0, K_PER_SPLIT, BLOCK_K):
        # A K tile of several groups of x's columns is that many products, each scaled by its own group's scales.
        for sub in tl.static_range(0, BLOCK_K, SUB_K):
            k = k_tile + sub
            if EVEN_K:
                w = tl.load(w_ptrs + k, mask=n_valid[:, None], other=0.0)
                x = tl.load(x_ptrs + k, mask=m_valid[None, :], other=0.0)
            else:
                k_valid = offs_k + k < K
                w = tl.load(w_ptrs + k, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
                x = tl.load(x_ptrs + k, mask=m_valid[None, :] & k_valid[:, None], other=0.0)
            if GATED:
                up = tl.load(up_ptrs + k, mask=n_valid[:, None], other=0.0) if EVEN_K else tl.load(
                    up_ptrs + k, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
            if not X_SCALED:
                w = w.to(DOT_DTYPE)
                x = x.to(DOT_DTYPE)
            if GROUPED or X_GROUPED:
                # The last slice of K may run whole tiles past K: their masked products are 0, and their scales,
                # past the row's last group (past the tensor at the last row), are not read.
                in_k = k_start + k < K
                product = tl.dot(w, x, max_num_imprecise_acc=IMPRECISE_ACC)
                if GATED:
                    product_up = tl.dot(up, x, max_num_imprecise_acc=IMPRECISE_ACC)
                if GROUPED:
                    group = (k_start + k) // GROUP_K
                    s = tl.load(w_scale_ptr + offs_n.to(tl.int64) * GROUPS + group, mask=n_valid & in_k, other=0.0)
                    product = product * s[:, None]
                    if GATED:
                        s_up = tl.load(w_scale_ptr + (offs_n + N).to(tl.int64) * GROUPS + group,
                                       mask=n_valid & in_k, other=0.0)
                        product_up = product_up * s_up[:, None]
                if X_GROUPED:
                    x_s = tl.load(x_scale_ptr + offs_m.to(tl.int64) * X_GROUPS + (k_start + k) // X_GROUP_K,
                                  mask=m_valid & in_k, other=0.0)
                    product = product * x_s[None, :]
                    if GATED:
                        product_up = product_up * x_s[None, :]
                acc += product
                if GATED:
                    acc_up += product_up
            else:
                acc = tl.dot(w, x, acc, max_num_imprecise_acc=IMPRECISE_ACC)
                if GATED:
                    acc_up = tl.dot(up, x, acc_up, max_num_imprecise_acc=IMPRECISE_ACC)
    if not GROUPED:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_valid, other=0.0)[:, None]
        if GATED:
            acc_up = acc_up * tl.load(w_scale_ptr + N + offs_n, mask=n_valid, other=0.0)[:, None]
    if X_SCALED and not X_GROUPED:
        x_s = tl.load(x_scale_ptr + offs_m, mask=m_valid, other=0.0)[None, :]
        acc = acc * x_s
        if GATED:
            acc_up = acc_up * x_s
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    if GATED:
        # Rounded where the unfused launches round: gate and up as the product writes them, the SiLU, the product
        # (activation.py); then this program's columns of each row cast as quantize_rows casts a row.
        gate = acc.to(ACT_DTYPE).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(ACT_DTYPE).to(tl.float32)
        h = (silu * acc_up.to(ACT_DTYPE).to(tl.float32)).to(ACT_DTYPE).to(tl.float32)
        scale = row_scale(abs_max(h, 0))  # [BLOCK_M]; columns past N read zero weights, so h is 0 there
        q = cast_to_fp8_range(h, scale[None, :])
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=n_valid[:, None] & m_valid[None, :])
        tl.store(out_scale_ptr + offs_m.to(tl.int64) * OUT_GROUPS + pid_n, scale, mask=m_valid)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_valid[:, None] & m_valid[None, :])


def _x_group(k: int, x_scale: torch.Tensor | None) -> int | None:
    """The columns each of a row's scales covers: None for one scale a row (or none: weight-only); else the power of
    two that cuts K into as many groups as x_scale has a row, the last of them possibly shorter."""
    if x_scale is None or x_scale.dim() == 1 or x_scale.shape[-1] == 1:
        return None
    return triton.next_power_of_2(triton.cdiv(k, x_scale.shape[-1]))


def _launch(x_q: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None, out_dtype: torch.dtype, partials: bool, tiles: Tiles | None,
            gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The product as [S, M, N]: S = 1 in out_dtype, or with `partials` S = tiles.split_k float32 partial sums.
    `gated`: w is [2N, K], and the result is ([1, M, N] fp8 rows of silu(gate) * up rounded to out_dtype, their
    scales [M, cdiv(N, ACT_GROUP)]); else the scales are None."""
    m, k = x_q.shape
    rows, groups = w.shape[0], w_scale.shape[-1]
    n = rows // 2 if gated else rows
    if w.shape[1] != k or w_scale.shape[0] != rows or k % groups or (gated and rows % 2):
        raise ValueError(f"fp8_matmul: x {tuple(x_q.shape)}, w {tuple(w.shape)} and w_scale {tuple(w_scale.shape)} "
                         "do not fit")
    if x_q.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("fp8_matmul: the K dimension of x and w must be contiguous")
    weight_only = x_scale is None
    if gated and weight_only:
        raise ValueError("fp8_silu_and_mul: the rows must be fp8 with their scales (W8A8)")
    x_group = _x_group(k, x_scale)
    if x_scale is not None:
        x_groups = x_scale.shape[-1] if x_scale.dim() == 2 else 1
        if x_scale.shape[0] != m or x_scale.dim() > 2 or (x_group is not None and (
                x_group < 32 or triton.cdiv(k, x_group) != x_groups)):
            # fp8 tensor-core products take K tiles of 32, and a K tile lies inside one group of a row's columns.
            raise ValueError(f"fp8_matmul: x_scale {tuple(x_scale.shape)} is not a scale per row, or per row and "
                             f"group of a power of two of at least 32 of x's {k} columns")
        x_scale = x_scale.float().contiguous()
    group_k = k // groups
    tiles = tiles or (gated_tiles(k, groups) if gated else choose_tiles(m, n, k, groups, x_group))
    if not partials:
        tiles = tiles._replace(split_k=1)
    if gated and tiles.block_n < 32:
        raise ValueError(f"fp8_silu_and_mul: act groups of {tiles.block_n} columns are under the 32 of a K tile")
    if groups > 1 and (group_k % tiles.block_k or tiles.block_k < 32 or tiles.block_k & (tiles.block_k - 1)):
        # fp8 tensor-core products take K tiles of 32, and a tile may not straddle two scale groups.
        raise ValueError(f"fp8_matmul: column groups of {group_k} are not a power of two of at least 32")
    split = tiles.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), tiles.block_k) * tiles.block_k
    out_groups = triton.cdiv(n, tiles.block_n)
    if gated:
        out = torch.empty(1, m, n, dtype=FP8, device=x_q.device)
        out_scale = torch.empty(m, out_groups, dtype=torch.float32, device=x_q.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=x_q.device)
        out_scale = None
    if m == 0:
        return out, out_scale
    block_m = row_block(m)
    w_scale = w_scale.float().contiguous()
    pdl = use_pdl(x_q)
    _fp8_matmul_kernel[(triton.cdiv(n, tiles.block_n), triton.cdiv(m, block_m), split)](
        x_q, w_scale if weight_only else x_scale, w, w_scale, bias if bias is not None else w_scale, out,
        out_scale if gated else w_scale,
        m, n, k, x_q.stride(0), w.stride(0), out.stride(0), out.stride(1), groups, group_k,
        1 if x_group is None else x_scale.shape[-1], x_group or k, out_groups, k_per_split,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SUB_K=min(tiles.block_k, x_group or k),
        EVEN_K=k % (split * tiles.block_k) == 0,
        GROUPED=groups > 1, X_GROUPED=x_group is not None, HAS_BIAS=bias is not None, X_SCALED=not weight_only,
        GATED=gated, ACT_DTYPE=triton_dtype(out_dtype), DOT_DTYPE=dot_dtype(x_q) if weight_only else tl.float8e4nv,
        IMPRECISE_ACC=None if weight_only else FP8_PROMOTE_EVERY, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, out_scale


def fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               tiles: Tiles | None = None) -> torch.Tensor:
    """x_q [M, K] fp8, x_scale [M] (or [M, G'] per group of columns), w [N, K] fp8, w_scale [N, G] -> [M, N] in
    out_dtype, by the Triton kernel. x_scale None: x_q is the float activations themselves, and the weights are
    widened to their dtype (W8A16). `tiles`: a cut other than choose_tiles' (its split is ignored: the product is
    one sum)."""
    return _launch(x_q, x_scale, w, w_scale, bias, out_dtype, False, tiles)[0][0]


def fp8_matmul_partials(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        tiles: Tiles | None = None) -> torch.Tensor:
    """fp8_matmul as float32 partial sums [S, M, N] whose sum over S is the product: the row-parallel
    projections' form, which the residual-add norm after them adds up as it reads (norm.py)."""
    return _launch(x_q, x_scale, w, w_scale, None, torch.float32, True, tiles)[0]


def fp8_silu_and_mul(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     act_dtype: torch.dtype, tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of the fp8 gate_up product (w [2I, K], gate rows then up rows, w_scale [2I, G]), rounded
    to act_dtype as fp8_matmul and silu_and_mul round it, and cast to fp8 in groups of ACT_GROUP columns, in one
    launch: (q [M, I] float8_e4m3fn, scale [M, cdiv(I, ACT_GROUP)] float32), q * scale ≈ the rounded rows."""
    out, scale = _launch(x_q, x_scale, w, w_scale, None, act_dtype, False, tiles, gated=True)
    return out[0], scale


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8_matmul by cuBLASLt (`torch._scaled_mm`, row-wise scales); w_scale [N, 1] only. cuBLASLt writes a
    row-wise scaled product in bf16 only: another out_dtype is that bf16 product, converted."""
    if w_scale.shape[-1] != 1:
        raise ValueError("scaled_mm: cuBLASLt's row-wise product takes one scale per weight row")
    out = torch._scaled_mm(x_q, w.t(), scale_a=x_scale.float().reshape(-1, 1),
                           scale_b=w_scale.float().reshape(1, -1), out_dtype=torch.bfloat16)
    out = out if bias is None else out + bias
    return out.to(out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K] @ (w * w_scale).T + bias -> [M, N] in x's dtype: activations cast per token in one launch, then
    the product that suits the rows (module note)."""
    return fp8_rows_linear(*quantize_rows(x.contiguous()), w, w_scale, bias, x.dtype)


def _takes_cublas(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> bool:
    # cuBLASLt's fp8 products take sizes that are multiples of 16 (a vocabulary of 258 rows is not), and one scale
    # a row of either operand.
    aligned = w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0
    return (x_q.is_cuda and x_q.shape[0] > TRITON_MAX_ROWS and w_scale.shape[-1] == 1 and x_scale.numel() == x_q.shape[0]
            and aligned and out_dtype == torch.bfloat16)


def fp8_rows_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear of rows already cast (by quantize_rows, or by the norm before the projection)."""
    product = scaled_mm if _takes_cublas(x_q, x_scale, w, w_scale, out_dtype) else fp8_matmul
    return product(x_q, x_scale, w, w_scale, bias, out_dtype)


def fp8_rows_partials(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_rows_linear as partial sums [S, M, N]: the Triton kernel's in float32, or cuBLASLt's one product (S = 1)
    in out_dtype."""
    if _takes_cublas(x_q, x_scale, w, w_scale, out_dtype):
        return scaled_mm(x_q, x_scale, w, w_scale, None, out_dtype)[None]
    return fp8_matmul_partials(x_q, x_scale, w, w_scale)


def fp8_rows_silu_and_mul(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                          act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated MLP's fp8 rows for its down projection, from rows already cast: `fp8_silu_and_mul` (scales per
    group of ACT_GROUP columns), or past TRITON_MAX_ROWS cuBLASLt's product, then `silu_and_mul_fp8` (a scale per
    row, [M, 1])."""
    if _takes_cublas(x_q, x_scale, w, w_scale, act_dtype):
        q, scale = silu_and_mul_fp8(scaled_mm(x_q, x_scale, w, w_scale, None, act_dtype))
        return q, scale[:, None]
    return fp8_silu_and_mul(x_q, x_scale, w, w_scale, act_dtype)
