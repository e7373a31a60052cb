"""DiffusionGemma's sampler over a canvas's logits, from the LM head's raw product: the kernel twin of
`row_statistics` in `diffulex_backend/strategies/diffusion_gemma.py`.

Each row's scores are its soft-capped logits over its temperature, s = cap tanh(x / cap) / T, formed in registers
from the head's raw product x, so no float32 copy of the logits is ever written. Two launches (three with chunks):
  - statistics: `sampling.py`'s kernel in its tempered form streams each row once for the sample (the Gumbel-max of
    s + g, g the reference's counter-hash noise of (row key, token id)), the argmax, the entropy and the logsumexp of
    softmax(s);
  - probabilities: softmax(s) = exp(s - logsumexp), written over the raw logits in their dtype, for the soft
    embedding's product that follows.
The module imports nothing from the engine.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .sampling import CONFIDENCE_NEG_ENTROPY, LOG2_E, SamplerLaunch, _scores, sample_and_confidence

PROBS_BLOCK = 4096  # vocabulary entries a probabilities program writes


class CanvasStatistics(NamedTuple):
    sampled: torch.Tensor  # [R] int64: argmax of s + g
    argmax: torch.Tensor  # [R] int64: argmax of s (the first, on ties)
    entropy: torch.Tensor  # [R] float32: -sum p log p of softmax(s)
    logsumexp: torch.Tensor  # [R] float32: log sum exp(s)


@triton.jit
def _canvas_probs_kernel(logits_ptr, temperature_ptr, logsumexp_ptr, stride_row, vocab_size, cap,
                         BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    index = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = index < vocab_size
    ptrs = logits_ptr + row.to(tl.int64) * stride_row + index
    s = _scores(tl.load(ptrs, mask=valid, other=0.0), cap, tl.load(temperature_ptr + row), SOFTCAP)
    p = tl.exp2((s - tl.load(logsumexp_ptr + row)) * LOG2_E)
    tl.store(ptrs, p.to(logits_ptr.dtype.element_ty), mask=valid)


def canvas_statistics(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, softcap: float | None,
                      *, launch: SamplerLaunch | None = None) -> CanvasStatistics:
    """logits: [R, V] the head's raw product (bf16, fp16 or float32); temperature: [R] float32, above 0; keys: [R]
    int64 noise keys (uint32 values). The statistics of s = softcap(logits) / temperature per row. `launch`: the
    tiles and chunks of the vocabulary, by default `sampling.py`'s plan for this many rows."""
    rows = logits.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    kinds = torch.full((rows,), CONFIDENCE_NEG_ENTROPY, dtype=torch.int64, device=logits.device)
    out = sample_and_confidence(logits, temperature, keys, kinds, launch=launch, tempered=True, softcap=softcap,
                                argmax=argmax)
    return CanvasStatistics(out.tokens, argmax, -out.confidence, out.logsumexp)


def canvas_probs_(logits: torch.Tensor, temperature: torch.Tensor, logsumexp: torch.Tensor,
                  softcap: float | None) -> torch.Tensor:
    """softmax(softcap(logits) / temperature) per row, written over `logits` (in their dtype) and returned."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    _canvas_probs_kernel[(num_rows, triton.cdiv(vocab_size, PROBS_BLOCK))](
        logits, temperature, logsumexp, logits.stride(0), vocab_size, 1.0 if softcap is None else float(softcap),
        BLOCK_V=PROBS_BLOCK, SOFTCAP=softcap is not None, num_warps=8,
    )
    return logits
