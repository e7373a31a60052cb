"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer. (The per-head q/k norms
run in the RoPE launch, rotary.py.)

One program per token row; the whole hidden vector (up to 8192 wide) sits in registers, so each input is
read once and each output written once. The statistics and the scaling run in float32.

The fused form also takes the product before it as split-K partial sums [S, T, hidden] (kernels/linear.py):
it adds them up and rounds the sum to the activation dtype, as the unsplit product would have been rounded.

The `_fp8` forms write the normalized rows as the input of an FP8 projection (kernels/fp8.py): each row cast to
float8_e4m3fn with its scale, from the registers that hold it, instead of written in the activation dtype and read
back by `quantize_rows`. The row is rounded to the activation dtype first, so the result is that of the two
launches, bit for bit, when the float norm runs at the cast norm's warps (its sums' order follows the warps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dtypes import triton_dtype
from .fp8_cast import abs_max, cast_to_fp8_range, row_scale
from .pdl import use_pdl, wait_for_previous_kernel

FP8 = torch.float8_e4m3fn


# The partials' stride is M x N, which changes with every batch.
@triton.jit(do_not_specialize=["stride_partial"])
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
    stride_partial, stride_x, stride_residual, stride_out, stride_residual_out,
    hidden_size, eps,
    NUM_PARTIALS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    FP8_OUT: tl.constexpr, ACT_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr = True,
):
    """FP8_OUT: out is float8_e4m3fn and scale_ptr gets each row's scale; ACT_DTYPE is the activations' dtype.
    Without HAS_WEIGHT the norm has no weight (weight_ptr is not read)."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if NUM_PARTIALS > 1:
        x = x.to(tl.float32)
        for part in tl.static_range(1, NUM_PARTIALS):
            x += tl.load(x_ptr + part * stride_partial + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    add_rmsnorm_row(x, row, cols, mask, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                    stride_residual, stride_out, stride_residual_out, hidden_size, eps, ADD_RESIDUAL, FP8_OUT,
                    ACT_DTYPE, HAS_WEIGHT)


@triton.jit
def add_rmsnorm_row(x, row, cols, mask, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                    stride_residual, stride_out, stride_residual_out, hidden_size, eps, ADD_RESIDUAL: tl.constexpr,
                    FP8_OUT: tl.constexpr, ACT_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """One row's norm, x (a [BLOCK] block of the row, its product's sum) added to the residual first with
    ADD_RESIDUAL; writes the row (cast with its scale with FP8_OUT) and the new residual. The norm kernel and the
    collective that sums a product over the ranks before its norm (peer_collectives.py) share it."""
    if ADD_RESIDUAL:
        # The product is rounded to the activation dtype, as an unfused matmul's output is; the sum is rounded
        # again, as the unfused `x + residual` would be, and the norm is taken of that rounded residual.
        x = x.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
        x += tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    y = x * inv_rms
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8_OUT:
        # As quantize_rows casts the rows the unfused norm writes (kernels/fp8.py).
        y = y.to(ACT_DTYPE).to(tl.float32)
        scale = row_scale(abs_max(y, 0))
        y = cast_to_fp8_range(y, scale)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# Fewer rows than an H100 has multiprocessors (132): one program a row leaves most of them idle, and a program's
# latency is the launch's.
FEW_ROWS = 128


def norm_warps(hidden_size: int, fp8_out: bool, num_rows: int) -> int:
    """Warps a row. Casting the row costs a second reduction (its largest magnitude) and a multiply per value: at
    few rows the cast norm takes twice the float norm's warps, which shorten each program where the float norm gains
    nothing, and at many rows half of them, which let more programs share a multiprocessor (benchmarks/fp8.py's
    casts section; docs/kernels.md)."""
    block = triton.next_power_of_2(hidden_size)
    per_warp = (256 if num_rows < FEW_ROWS else 1024) if fp8_out else 512
    return min(16, max(4, block // per_warp))


def _launch(x, residual, weight, eps, out, residual_out, scale=None, act_dtype=None, num_warps=None):
    partials = x if x.dim() == 3 else x[None]
    x = partials[0]
    num_rows, hidden_size = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rmsnorm: the hidden dimension must be contiguous")
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden_size)
    add = residual is not None
    _rmsnorm_kernel[(num_rows,)](
        x, residual if add else x, x if weight is None else weight, out, residual_out if add else out,
        out if scale is None else scale,
        partials.stride(0), x.stride(0), residual.stride(0) if add else 0, out.stride(0),
        residual_out.stride(0) if add else 0,
        hidden_size, eps,
        NUM_PARTIALS=partials.shape[0], ADD_RESIDUAL=add, BLOCK=block, FP8_OUT=scale is not None,
        ACT_DTYPE=tl.float32 if scale is None else triton_dtype(act_dtype), HAS_WEIGHT=weight is not None,
        USE_PDL=use_pdl(x), launch_pdl=use_pdl(x),
        num_warps=norm_warps(hidden_size, scale is not None, num_rows) if num_warps is None else num_warps,
    )


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, out: torch.Tensor | None = None,
    num_warps: int | None = None,  # a launch other than norm_warps' (benchmarks, tests)
) -> torch.Tensor:
    """x: [T, hidden]; returns x / rms(x) * weight (x / rms(x) where weight is None), computed in float32, in x's
    dtype."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, eps, out, None, num_warps=num_warps)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,  # may be `residual` itself: each row is read before it is written
    num_warps: int | None = None,  # a launch other than norm_warps' (benchmarks, tests)
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden], or x as split-K partial sums [S, T, hidden]. Returns (rmsnorm(x + residual),
    x + residual) in one pass."""
    out = torch.empty_like(residual) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    _launch(x, residual, weight, eps, out, residual_out, num_warps=num_warps)
    return out, residual_out


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm(x, weight, eps) cast per row to fp8: (q [T, hidden] float8_e4m3fn, scale [T] float32), as
    quantize_rows(rmsnorm(...)) gives them."""
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, None, weight, eps, out, None, scale, x.dtype)
    return out, scale


def fused_add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """fused_add_rmsnorm with the normalized rows cast per row to fp8: ((q, scale), x + residual). `num_warps`: a
    launch other than norm_warps' (benchmarks)."""
    out = torch.empty(residual.shape, dtype=FP8, device=residual.device)
    scale = torch.empty(residual.shape[0], dtype=torch.float32, device=residual.device)
    residual_out = torch.empty_like(residual)
    _launch(x, residual, weight, eps, out, residual_out, scale, residual.dtype, num_warps=num_warps)
    return (out, scale), residual_out
