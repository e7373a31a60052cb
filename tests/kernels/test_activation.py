"""SiLU-and-mul matches silu(gate) * up on the fused gate_up output."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffulex_kernels.activation import silu_and_mul
from kernel_cases import FULL_SHAPES, generator, randn, relative_error

# (tokens, intermediate): LLaDA-8B and Dream-7B, or small ones with a ragged tile.
SHAPES = [(2048, 12288), (2048, 18944)] if FULL_SHAPES else [(3, 1500), (4, 96)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_and_mul_matches_the_two_torch_ops(shape, dtype):
    tokens, size = shape
    gen = generator(tokens * size)
    gate_up = randn(tokens, 2 * size, dtype=dtype, gen=gen) * 3
    gate, up = gate_up.split(size, dim=-1)
    expected = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == expected.shape
    assert relative_error(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_rows_of_a_strided_buffer():
    # The kernel reads each row through its stride, so it may take a slice of a wider buffer.
    gen = generator(3)
    wide = randn(5, 3 * 256, dtype=torch.float32, gen=gen)
    gate_up = wide[:, : 2 * 256]
    gate, up = gate_up.split(256, dim=-1)
    assert relative_error(silu_and_mul(gate_up), F.silu(gate) * up) < 1e-6
