"""Weight-streaming matmul for small token counts: y = x @ w.T (+ bias), x [M, K] with M small, w [N, K] large.

At a few dozen tokens the product is bound by reading w once, and what counts is keeping enough loads in flight
until the last byte. Each program owns BLOCK_N rows of w and one of `split_k` slices of K, and computes
w_tile @ x_tile.T: the tensor cores' wide side is the weight rows, the narrow side the tokens.

`linear_partials` splits K when the weight has too few row tiles to occupy every multiprocessor (the square
o_proj, the tall down_proj). It returns the float32 partial sums [split_k, M, N]; the fused residual-add
RMSNorm that consumes those products adds them up as it reads, so the split costs no extra launch.

`linear_silu_and_mul` is the gated MLP's gate_up projection with SiLU-and-mul in its epilogue: a program owns
BLOCK_N gate rows and the BLOCK_N up rows that pair with them, and writes silu(gate) * up, rounded as the separate
kernel rounds it. It saves a launch per layer and the round trip of the [M, 2I] product.

Past `MAX_TOKENS` rows cuBLAS is faster, and the three functions hand over to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_and_mul
from .dtypes import dot_dtype
from .pdl import use_pdl, wait_for_previous_kernel

# Up to here streaming the weight once beats the library's tiles; past it, cuBLAS's larger tiles win (the figures are
# in docs/kernels.md, "Weight-streaming matmul").
MAX_TOKENS = 64
BLOCK_N = 64
BLOCK_K = 128
# Enough programs for about one per multiprocessor of an H100 (132), before a split of K is worth its partials.
MIN_PROGRAMS = 120


# M (and the partials' stride, M x N) change with every batch: specialized on them, each new token count class
# would compile again while requests wait.
@triton.jit(do_not_specialize=["M", "stride_os"])
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_os, stride_om,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """GATED: w is [2N, K], gate rows then up rows, and the output is silu(x @ gate.T) * (x @ up.T)."""
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
    n_valid = offs_n[:, None] < N
    m_valid = offs_m[None, :] < M
    up_ptrs = w_ptrs + N * stride_wn  # GATED only
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_valid, other=0.0)
            x = tl.load(x_ptrs, mask=m_valid, other=0.0)
        else:
            k_valid = offs_k + k < K
            w = tl.load(w_ptrs, mask=n_valid & k_valid[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_valid & k_valid[:, None], other=0.0)
        acc = tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), acc)
        if GATED:
            if EVEN_K:
                w_up = tl.load(up_ptrs, mask=n_valid, other=0.0)
            else:
                w_up = tl.load(up_ptrs, mask=n_valid & k_valid[None, :], other=0.0)
            acc_up = tl.dot(w_up.to(DOT_DTYPE), x.to(DOT_DTYPE), acc_up)
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    if GATED:
        # Rounded where the unfused path rounds: gate and up as the projection writes them, then the SiLU.
        out_dtype = out_ptr.dtype.element_ty
        gate = acc.to(out_dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        acc = silu * acc_up.to(out_dtype).to(tl.float32)
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_valid & m_valid)


def choose_split_k(n: int, k: int) -> int:
    """The fewest K slices (a power of two, at most 8) that give about one program per multiprocessor; each
    slice keeps at least one whole BLOCK_K tile."""
    row_tiles, split = triton.cdiv(n, BLOCK_N), 1
    while split < 8 and row_tiles * split < MIN_PROGRAMS and 2 * split * BLOCK_K <= k:
        split *= 2
    return split


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split_k: int,
            gated: bool = False):
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear: the K dimension of x and weight must be contiguous")
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), BLOCK_K) * BLOCK_K
    block_m = max(16, triton.next_power_of_2(m))
    pdl = use_pdl(x)
    even_k = k % (split_k * BLOCK_K) == 0
    _linear_kernel[(triton.cdiv(n, BLOCK_N), split_k)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), out.stride(1), k_per_split,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, EVEN_K=even_k,
        HAS_BIAS=bias is not None, GATED=gated, DOT_DTYPE=dot_dtype(x), USE_PDL=pdl, launch_pdl=pdl,
        # As many loads in flight as shared memory holds at 64 tokens: five stages of one weight tile, four of the
        # gated pair. Fewer stages leave the weight stream short of loads in flight (docs/kernels.md).
        num_warps=4, num_stages=4 if gated else 5,
    )


def _streams(x: torch.Tensor) -> bool:
    """Whether the product goes to this kernel: a few token rows, in a 16-bit dtype on the GPU (a float32 dot
    would run in tf32 there, less exact than the library's float32 matmul; the interpreter computes it exactly)."""
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and (x.dtype != torch.float32 or not x.is_cuda)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [M, K], weight [N, K] -> [M, N] in x's dtype."""
    if not _streams(x):
        return F.linear(x, weight, bias)
    out = torch.empty(1, x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, split_k=1)
    return out[0]


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as partial sums [S, M, N] whose sum over S is the product: float32 from the split kernel,
    or the one cuBLAS product in x's dtype (S = 1) past MAX_TOKENS rows."""
    if not _streams(x):
        return F.linear(x, weight)[None]
    split_k = choose_split_k(weight.shape[0], x.shape[1])
    out = torch.empty(split_k, x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, weight, None, out, split_k)
    return out


def linear_silu_and_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x, gate_up)): x [M, K], gate_up [2I, K] with rows [gate; up] -> [M, I]."""
    if not _streams(x):
        return silu_and_mul(F.linear(x, gate_up))
    if gate_up.shape[0] % 2:
        raise ValueError(f"linear_silu_and_mul: gate_up must have an even number of rows, got {gate_up.shape[0]}")
    out = torch.empty(1, x.shape[0], gate_up.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, None, out, split_k=1, gated=True)
    return out[0]
