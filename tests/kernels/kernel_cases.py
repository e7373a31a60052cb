"""Inputs for the kernel tests: random data, poisoned outputs, and the size of the shapes.

Without a GPU the kernels run under Triton's interpreter at small shapes; `DIFFULEX_FULL_SHAPES=1` (on a GPU machine)
runs the same tests at the shapes of the served models."""
from __future__ import annotations

import os

import torch

FULL_SHAPES = os.environ.get("DIFFULEX_FULL_SHAPES") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# ‖out − ref‖ / ‖ref‖ allowed per input dtype: bf16/fp16 round the output and the softmax weights fed to
# the second matmul; fp32 may run its matmuls in tf32 on the GPU.
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 2e-3}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so that any element the kernel forgets to write fails the comparison."""
    return torch.full_like(tensor, float("nan"))


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def assert_equal_after_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit where the kernel is compiled. Triton's interpreter (CPU) truncates float32 to bfloat16
    instead of rounding to nearest even, so there a bfloat16 result may be one unit in the last place off."""
    if DEVICE.type == "cuda" or out.dtype != torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        one_ulp = expected.float().abs() * 2.0**-7
        assert ((out.float() - expected.float()).abs() <= one_ulp).all()


def graph_and_eager_tokens(path: str, prompts: list[str], params, check=None, **settings) -> list[list[list[int]]]:
    """The tokens of `prompts` from an engine whose steps replay CUDA graphs, then from one that steps eagerly,
    over the same checkpoint and settings; `check(llm)` runs on each engine before it generates."""
    from diffulex_backend import Diffulex

    outputs = []
    for eager in (False, True):
        llm = Diffulex(path, **settings, enforce_eager=eager)
        try:
            if check is not None:
                check(llm)
            outputs.append([o.token_ids for o in llm.generate(prompts, params)])
            if not eager:
                assert llm.runner.padded_forward.graphs, "no step replayed a graph"
        finally:
            llm.close()
    return outputs
