"""The cast of a row to float8_e4m3fn with a scale of its own, as the kernels that write fp8 activations share it
(`quantize_rows`, the casting norms, the SiLU-and-mul); the fp8 KV store takes its rows' largest magnitudes here
too, and makes its scales its own way (kv_store.py).

A row's scale is its largest magnitude over 448 (the largest finite e4m3 value), never below float32's smallest
normal, so that an all-zero row has a finite reciprocal; each value is multiplied by the scale's reciprocal and
clamped to ±448. The scale and its reciprocal are divisions that round to nearest, as torch divides two tensors, and
a multiply rounds the same everywhere, so that a kernel's scale and fp8 values equal the torch reference's bit for
bit. One division a row and a multiply a value: a division a value took a cast norm's program about as long again
as its sums (docs/kernels.md, "FP8 products").

NaN goes through as torch lets it through: a row holding a NaN gets a NaN scale and NaN values, and an infinite
magnitude an infinite scale. Triton's maximum, minimum and max reduction drop a NaN on a GPU by default, which
would turn a NaN row into finite values at full magnitude; here each is told to keep it. The interpreter cannot
show the difference (its maximum and minimum keep NaN whatever they are told, its max reduction drops it), so
tests/kernels/test_fp8_cast_ir.py reads the compiled kernels' IR instead.
"""
from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1.1754943508222875e-38  # float32's smallest normal
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max(x, axis):
    """The largest value of x along `axis`; NaN where a NaN is among them."""
    return tl.reduce(x, axis, _max_keeping_nan)


@triton.jit
def abs_max(x, axis):
    """The largest magnitude of x along `axis`; NaN where a NaN is among them, as torch's amax."""
    return nan_max(tl.abs(x), axis)


@triton.jit
def row_scale(amax):
    """A row's fp8 scale from its largest magnitude (float32)."""
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def cast_to_fp8_range(x, scale):
    """x (float32) times its scale's reciprocal, clamped to ±448, in float32: its fp8 value once converted. `scale`
    is a row's (or broadcasts over x), so the reciprocal is one division a row."""
    q = tl.maximum(x * tl.math.div_rn(1.0, scale), -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(q, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
