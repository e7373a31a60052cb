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
- `scaled_mm` is cuBLASLt's FP8 product through `torch._scaled_mm`, with row-wise scales (one per token, one per
  weight row); it takes G = 1 only.
`fp8_linear` and `fp8_rows_partials` choose: the Triton kernel up to `TRITON_MAX_ROWS` rows, for block scales and
for activations other than bf16 (cuBLASLt writes row-wise scaled products in bf16 only), `scaled_mm` otherwise
(benchmarks/fp8.py measures both at a decode step's shapes).

The scales are float32 and every product accumulates in float32. A product is in the activations' dtype, the
Triton kernel's partial sums in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .activation import cast_chunks, silu_and_mul_fp8, silu_times_up
from .dtypes import dot_dtype
from .fp8_cast import FP8_MAX, MIN_SCALE, abs_max, cast_to_fp8_range, row_scale
from .pdl import use_pdl, wait_for_previous_kernel

FP8 = torch.float8_e4m3fn
# Rows up to which the Triton kernel runs a per-channel product, past which cuBLASLt does: a decode step's block
# of 32 rows streams the weights (the Triton kernel's shape), 1024 rows are a compute-bound GEMM.
TRITON_MAX_ROWS = 64
BLOCK_N = 64
BLOCK_K = 128
NUM_STAGES = 4
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
    # Tensor divisors: torch on CUDA multiplies by the reciprocal of a scalar one, which is not the division the
    # kernel (and torch on the CPU) rounds.
    amax = x.abs().amax(-1)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    inverse = torch.ones_like(scale) / scale
    return (x * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


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


def choose_tiles(m: int, n: int, k: int, groups: int = 1) -> Tiles:
    """The tiles of an [M, K] @ [N, K].T product.

    At a decode step's few rows the product streams the weight once, and its speed is the loads in flight. Tiles of
    64 weight rows by 128 columns, four stages deep, are small enough that a multiprocessor holds several programs
    at once, and K is split until there are about two programs per multiprocessor: on an H200 that streams LLaDA-8B's
    projections at 32 rows faster than deeper tiles (256 columns) or pipelines (five stages) do, which leave fewer
    programs on each multiprocessor (benchmarks/fp8.py's tiles section; docs/kernels.md). Four such stages take at
    most 96 KB of shared memory. A block-scaled weight's K tile stays within one scale group."""
    block_k = BLOCK_K if groups == 1 else min(BLOCK_K, k // groups)
    programs = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, row_block(m))
    split = 1
    while split < MAX_SPLIT_K and programs * split < MIN_PROGRAMS and 2 * split * block_k <= k:
        split *= 2
    return Tiles(BLOCK_N, block_k, split, 4, NUM_STAGES)


# M changes with every batch, and the partials' stride (M x N) with it: specialized on them, each new token count
# class would compile again.
@triton.jit(do_not_specialize=["M", "stride_os"])
def _fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, amax_ptr,
    M, N, K, stride_xm, stride_wn, stride_os, stride_om, GROUPS, GROUP_K, K_PER_SPLIT, num_chunks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] = w_tile @ x_tile.T over this program's slice of K, written to its partial
    (out + pid_k * stride_os); GROUPED: each K tile scaled by its column group's scale (GROUP_K a multiple of
    BLOCK_K), else the row scale after the loop. X_SCALED: x is fp8 with a scale per row (W8A8); else x is in its
    float dtype and the weight tile is widened to DOT_DTYPE in registers (W8A16). The bias goes to slice 0.
    GATED: w is [2N, K], gate rows then up rows; a program's tile is BLOCK_N / 2 gate rows and the up rows of the
    same columns, and it writes silu(gate) * up ([M, N], one slice) and, for each row, the largest magnitude of its
    BLOCK_N / 2 columns (amax_ptr [M, num_chunks], column pid_n)."""
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    if GATED:
        local = tl.arange(0, BLOCK_N)
        columns = pid_n * (BLOCK_N // 2) + local % (BLOCK_N // 2)
        n_valid = columns < N
        offs_n = columns + (local >= BLOCK_N // 2).to(tl.int32) * N  # the weight rows
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = pid_k * K_PER_SPLIT
    offs_k = k_start + tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_valid[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_valid[None, :], other=0.0)
        else:
            k_valid = offs_k + k < K
            w = tl.load(w_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_valid[None, :] & k_valid[:, None], other=0.0)
        if not X_SCALED:
            w = w.to(DOT_DTYPE)
            x = x.to(DOT_DTYPE)
        if GROUPED:
            # The last slice of K may run whole tiles past K: their masked products are 0, and their scales, past
            # the row's last group (past the tensor at the last row), are not read.
            s = tl.load(w_scale_ptr + offs_n.to(tl.int64) * GROUPS + (k_start + k) // GROUP_K,
                        mask=n_valid & (k_start + k < K), other=0.0)
            acc += tl.dot(w, x, max_num_imprecise_acc=IMPRECISE_ACC) * s[:, None]
        else:
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not GROUPED:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_valid, other=0.0)[:, None]
    if X_SCALED:
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_valid, other=0.0)[None, :]
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[:, None]
    if GATED:
        # The product rounded to the activations' dtype, as the unfused product writes it for the SiLU-and-mul.
        product = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(product, [2, BLOCK_N // 2, BLOCK_M]), [1, 2, 0]))
        h = silu_times_up(gate, up, out_ptr.dtype.element_ty)  # [BLOCK_N / 2, BLOCK_M]; 0 past the last column
        columns = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + columns[:, None], h,
                 mask=(columns < N)[:, None] & m_valid[None, :])
        tl.store(amax_ptr + offs_m.to(tl.int64) * num_chunks + pid_n, abs_max(h.to(tl.float32), 0), mask=m_valid)
    else:
        out_ptrs = out_ptr + pid_k * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_valid[:, None] & m_valid[None, :])


def _launch(x_q: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None, out_dtype: torch.dtype, partials: bool, tiles: Tiles | None,
            gated: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The product as [S, M, N]: S = 1 in out_dtype, or with `partials` S = tiles.split_k float32 partial sums.
    `gated` (w [2I, K], gate rows then up rows): (silu(gate) * up [M, I] in out_dtype, the largest magnitude of
    each row's chunk of columns [M, chunks] float32), the kernel's GATED epilogue."""
    m, k = x_q.shape
    n, groups = w.shape[0], w_scale.shape[-1]
    if gated and (n % 2 or bias is not None or partials):
        raise ValueError(f"fp8_matmul: a gated product takes gate and up rows alike ({n} rows), no bias and one sum")
    if w.shape[1] != k or w_scale.shape[0] != n or k % groups:
        raise ValueError(f"fp8_matmul: x {tuple(x_q.shape)}, w {tuple(w.shape)} and w_scale {tuple(w_scale.shape)} "
                         "do not fit")
    if x_q.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("fp8_matmul: the K dimension of x and w must be contiguous")
    group_k = k // groups
    weight_only = x_scale is None
    tiles = tiles or choose_tiles(m, n, k, groups)
    if not partials:
        tiles = tiles._replace(split_k=1)
    if groups > 1 and (group_k % tiles.block_k or tiles.block_k < 32 or tiles.block_k & (tiles.block_k - 1)):
        # fp8 tensor-core products take K tiles of 32, and a tile may not straddle two scale groups.
        raise ValueError(f"fp8_matmul: column groups of {group_k} are not a power of two of at least 32")
    split = tiles.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), tiles.block_k) * tiles.block_k
    columns = n // 2 if gated else n  # the output's
    out = torch.empty(split, m, columns, dtype=torch.float32 if split > 1 else out_dtype, device=x_q.device)
    # Gated: a program's columns are half its weight rows.
    chunk_amax = torch.empty(m, triton.cdiv(columns, tiles.block_n // 2) if gated else 0, dtype=torch.float32,
                             device=x_q.device)
    if m:
        block_m = row_block(m)
        w_scale = w_scale.float().contiguous()
        pdl = use_pdl(x_q)
        _fp8_matmul_kernel[(triton.cdiv(columns, tiles.block_n // 2 if gated else tiles.block_n),
                            triton.cdiv(m, block_m), split)](
            x_q, w_scale if weight_only else x_scale, w, w_scale, bias if bias is not None else w_scale, out,
            chunk_amax, m, columns, k, x_q.stride(0), w.stride(0), out.stride(0), out.stride(1), groups, group_k,
            k_per_split, chunk_amax.shape[1],
            BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=k % (split * tiles.block_k) == 0,
            GROUPED=groups > 1, HAS_BIAS=bias is not None, X_SCALED=not weight_only,
            DOT_DTYPE=dot_dtype(x_q) if weight_only else tl.float8e4nv,
            IMPRECISE_ACC=None if weight_only else FP8_PROMOTE_EVERY, GATED=gated, USE_PDL=pdl, launch_pdl=pdl,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return (out[0], chunk_amax) if gated else out


def fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               tiles: Tiles | None = None) -> torch.Tensor:
    """x_q [M, K] fp8, x_scale [M], w [N, K] fp8, w_scale [N, G] -> [M, N] in out_dtype, by the Triton kernel.
    x_scale None: x_q is the float activations themselves, and the weights are widened to their dtype (W8A16).
    `tiles`: a cut other than choose_tiles' (its split is ignored: the product is one sum)."""
    return _launch(x_q, x_scale, w, w_scale, bias, out_dtype, False, tiles)[0]


def fp8_silu_and_mul(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None, tiles: Tiles | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x_q [M, K] fp8 with x_scale [M], w [2I, K] (gate rows then up rows) with w_scale [2I, G] -> silu(x @ gate.T)
    * (x @ up.T) cast per row for an fp8 down projection: (q [M, I] float8_e4m3fn, scale [M] float32), equal to
    `silu_and_mul_fp8(fp8_rows_linear(...))` bit for bit. Where the Triton kernel takes the product, the SiLU-and-mul
    runs in its epilogue, which writes it with the largest magnitude of each program's columns of each row, and
    one more launch casts the rows (`activation.cast_chunks`); cuBLASLt's product (past TRITON_MAX_ROWS rows), and
    a product with a bias, are followed by the two-launch SiLU-and-mul. `tiles`: a cut other than choose_tiles' (one
    K slice)."""
    if bias is not None or _takes_cublas(x_q, w, w_scale, out_dtype):
        return silu_and_mul_fp8(fp8_rows_linear(x_q, x_scale, w, w_scale, bias, out_dtype))
    return cast_chunks(*_launch(x_q, x_scale, w, w_scale, None, out_dtype, False, tiles, gated=True))


def fp8_matmul_partials(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        tiles: Tiles | None = None) -> torch.Tensor:
    """fp8_matmul as float32 partial sums [S, M, N] whose sum over S is the product: the row-parallel
    projections' form, which the residual-add norm after them adds up as it reads (norm.py)."""
    return _launch(x_q, x_scale, w, w_scale, None, torch.float32, True, tiles)


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


def _takes_cublas(x_q: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> bool:
    # cuBLASLt's fp8 products take sizes that are multiples of 16 (a vocabulary of 258 rows is not).
    aligned = w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0
    return (x_q.is_cuda and x_q.shape[0] > TRITON_MAX_ROWS and w_scale.shape[-1] == 1 and aligned
            and out_dtype == torch.bfloat16)


def fp8_rows_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear of rows already cast (by quantize_rows, or by the norm before the projection)."""
    product = scaled_mm if _takes_cublas(x_q, w, w_scale, out_dtype) else fp8_matmul
    return product(x_q, x_scale, w, w_scale, bias, out_dtype)


def fp8_rows_partials(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_rows_linear as partial sums [S, M, N]: the Triton kernel's in float32, or cuBLASLt's one product (S = 1)
    in out_dtype."""
    if _takes_cublas(x_q, w, w_scale, out_dtype):
        return scaled_mm(x_q, x_scale, w, w_scale, None, out_dtype)[None]
    return fp8_matmul_partials(x_q, x_scale, w, w_scale)
