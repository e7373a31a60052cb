"""Inputs for the kernel tests: random data, poisoned outputs, and the size of the shapes.

Without a GPU the kernels run under Triton's interpreter at small shapes; `DIFFULEX_FULL_SHAPES=1` (on a GPU machine)
runs the same tests at the shapes of the served models."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FULL_SHAPES = os.environ.get("DIFFULEX_FULL_SHAPES") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# ‖out − ref‖ / ‖ref‖ allowed per input dtype: bf16/fp16 round the output and the softmax weights fed to
# the second matmul; fp32 may run its matmuls in tf32 on the GPU.
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 2e-3}
# A float32 graph replay's rows against the unpadded eager forward of its step (replay_against_eager), as
# ||replay - eager|| / ||eager|| over the step: other launches round otherwise, 2e-6 to 2e-4 through the small
# random models of tests/kernels on an H200. One corrupted row among a step's 16 is off by about 0.25.
REPLAY_BOUND = 1e-3
# The same with fp8 weights or an fp8 cache. Where the two forwards' float32 values differ in their last bits, a
# cast can round an element to the next e4m3 value (2^-4 of it) in one and not in the other, and the random
# models' sharp attention carries that on: 0.010 and 0.014 with fp8 weights. Still a fifth of one corrupted row.
FP8_REPLAY_BOUND = 5e-2


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


@dataclass
class GraphSteps:
    """What `replay_against_eager` saw, one entry per step that replayed a CUDA graph."""

    padded: list[float]  # max |replay - the same padded forward run eagerly|: 0 where the capture holds
    eager: list[float]  # ||replay - the eager forward of the step's own rows|| / ||that forward||


def replay_against_eager(llm, prompts, params) -> GraphSteps:
    """Generates `prompts` on `llm`, whose steps replay CUDA graphs, and runs every replayed step twice more over
    the same batch: padded as the graph pads it, and unpadded, both eagerly. The hidden states are compared, not
    the tokens. A replay must equal its own padded forward bit for bit. The unpadded forward takes other launches
    (a GEMM's tiles for another row count, the attention's splits for the real context instead of the bucket's),
    and a random model's sampler turns that float32 rounding into other tokens, where a row that the padding
    corrupts or an input that misses the replay is off by the whole. Each forward stores the same K/V again; the
    unpadded one, last, stores the step's."""
    from diffulex_backend.cuda_graph import PaddedForward

    runner = llm.runner
    graphs = runner.padded_forward
    assert graphs is not None, "the engine runs without CUDA graphs"
    padded = PaddedForward(runner.model, runner.kv_cache, runner.config, graphs.device, runner.token_merge)
    replayed = runner.forward
    seen = GraphSteps([], [])

    def forward_thrice(batch, lora=None, inputs=None, rows=None):
        hidden = replayed(batch, lora, inputs, rows).clone()
        bucket = graphs.bucket_for(batch, lora)
        if bucket is not None:
            ids = None if inputs is None else inputs[0]
            seen.padded.append((hidden - padded.run(bucket, batch, lora, ids, rows)).abs().max().item())
            runner.padded_forward = None
            try:
                seen.eager.append(relative_error(hidden, replayed(batch, lora, inputs, rows)))
            finally:
                runner.padded_forward = graphs
        return hidden

    runner.forward = forward_thrice
    try:
        llm.generate(prompts, params)
    finally:
        runner.forward = replayed
    assert graphs.graphs and seen.padded, "no step replayed a graph"
    print(f"{len(seen.padded)} replays: padded forward off by at most {max(seen.padded):.3g}, "
          f"unpadded by {max(seen.eager):.3g} relative")
    return seen
