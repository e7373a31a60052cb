"""DiffusionGemma's sampler over a canvas's logits, from the LM head's raw product: the kernel twin of
`row_statistics` in `diffulex_backend/strategies/diffusion_gemma.py`.

Each row's scores are its soft-capped logits over its temperature, s = cap tanh(x / cap) / T, formed in registers
from the head's raw product x, so no float32 copy of the logits is ever written. Two launches:
  - statistics: a program per (row, chunk of the vocabulary) streams its tiles once, keeping the online softmax of
    s (max, sum, entropy accumulator, in base 2), its first argmax, and the Gumbel-max candidate of s + g, where g is
    the reference's counter-hash noise of (row key, token id); a merge per row combines its chunks in vocabulary
    order, as `sampling.py`'s merge does, and writes the sample, the argmax, the entropy and the logsumexp;
  - probabilities: softmax(s) = exp(s - logsumexp), written over the raw logits in their dtype, for the soft
    embedding's product that follows.
The module imports nothing from the engine.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .device import multiprocessor_count
from .sampling import (LN_2, LOG2_E, SamplerLaunch, _add_tile, _merge_parts, _mix32, chunk_layout,
                       plan_sampler_launch)

NUM_STATS = 4  # base-2 max, sum of exponentials, entropy accumulator, best Gumbel score (top-1 rides in _add_tile)
PROBS_BLOCK = 4096  # vocabulary entries a probabilities program writes


class CanvasStatistics(NamedTuple):
    sampled: torch.Tensor  # [R] int64: argmax of s + g
    argmax: torch.Tensor  # [R] int64: argmax of s (the first, on ties)
    entropy: torch.Tensor  # [R] float32: -sum p log p of softmax(s)
    logsumexp: torch.Tensor  # [R] float32: log sum exp(s)


@triton.jit
def _scores(x, cap, temperature, SOFTCAP: tl.constexpr):
    """s = cap tanh(x / cap) / T in float32; tanh as 2 sigmoid(2y) - 1, which saturates to +-1 where exp overflows
    (its error, about 1e-7 of the cap, is far below one rounding of a bf16 logit)."""
    x = x.to(tl.float32)
    if SOFTCAP:
        x = cap * (2.0 / (1.0 + tl.exp(-2.0 * tl.math.div_rn(x, cap))) - 1.0)
    return tl.math.div_rn(x, temperature)


@triton.jit
def _canvas_stats_kernel(
    logits_ptr, temperature_ptr, keys_ptr, part_stats_ptr, part_index_ptr,
    stride_row, vocab_size, chunk_size, cap,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, STATS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chunk_begin = chunk * chunk_size
    chunk_end = tl.minimum(vocab_size, chunk_begin + chunk_size)
    temperature = tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    offsets = tl.arange(0, BLOCK_V)
    run_max = -1.0e30  # finite, so that the first rescale is exp2(-huge) = 0, not NaN
    run_sum = 0.0
    run_ent = 0.0
    top1 = float("-inf")
    top1_index = 0
    top2 = float("-inf")
    best_score = float("-inf")
    best_index = 0
    for start in range(chunk_begin, chunk_end, BLOCK_V):
        index = start + offsets
        valid = index < chunk_end
        raw = tl.load(row_ptr + index, mask=valid, other=0.0)
        s = tl.where(valid, _scores(raw, cap, temperature, SOFTCAP), float("-inf"))
        run_max, run_sum, run_ent, top1, top1_index, top2 = _add_tile(
            s, offsets, start, run_max, run_sum, run_ent, top1, top1_index, top2)
        noise_hash = _mix32(key ^ _mix32(index.to(tl.uint32)))
        uniform = ((noise_hash >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact in float32, < 1
        score = tl.where(valid, s - tl.log(-tl.log(uniform)), float("-inf"))
        tile_best, tile_best_arg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_index = tl.where(tile_best > best_score, start + tile_best_arg, best_index)
        best_score = tl.maximum(best_score, tile_best)
    part = row * tl.num_programs(1) + chunk
    stats_ptr = part_stats_ptr + part * STATS
    tl.store(stats_ptr + 0, run_max)
    tl.store(stats_ptr + 1, run_sum)
    tl.store(stats_ptr + 2, run_ent)
    tl.store(stats_ptr + 3, best_score)
    tl.store(part_stats_ptr + tl.num_programs(0) * tl.num_programs(1) * STATS + part, top1)  # after the stats
    tl.store(part_index_ptr + part * 2, top1_index)
    tl.store(part_index_ptr + part * 2 + 1, best_index)


@triton.jit(do_not_specialize=["num_chunks"])
def _canvas_merge_kernel(
    part_stats_ptr, part_index_ptr, sampled_ptr, argmax_ptr, entropy_ptr, logsumexp_ptr, num_rows, num_chunks,
    CHUNKS: tl.constexpr, STATS: tl.constexpr,
):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    part = row * num_chunks + chunks
    stats_ptr = part_stats_ptr + part * STATS
    chunk_max = tl.load(stats_ptr + 0, mask=valid, other=-1.0e30)
    chunk_sum = tl.load(stats_ptr + 1, mask=valid, other=0.0)
    chunk_ent = tl.load(stats_ptr + 2, mask=valid, other=0.0)
    chunk_best = tl.load(stats_ptr + 3, mask=valid, other=float("-inf"))
    chunk_top1 = tl.load(part_stats_ptr + num_rows * num_chunks * STATS + part, mask=valid, other=float("-inf"))
    run_max, run_sum, run_ent, _, top1_chunk, _ = _merge_parts(
        chunk_max, chunk_sum, chunk_ent, chunk_top1, chunk_top1, chunks)
    _, best_chunk = tl.max(chunk_best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(argmax_ptr + row, tl.load(part_index_ptr + (row * num_chunks + top1_chunk) * 2).to(tl.int64))
    tl.store(sampled_ptr + row, tl.load(part_index_ptr + (row * num_chunks + best_chunk) * 2 + 1).to(tl.int64))
    log2_sum = tl.log2(run_sum)
    tl.store(entropy_ptr + row, -LN_2 * (run_ent / run_sum - log2_sum))
    tl.store(logsumexp_ptr + row, (run_max + log2_sum) * LN_2)


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
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("canvas_statistics: logits need a contiguous vocabulary dimension")
    device = logits.device
    out = CanvasStatistics(torch.empty(num_rows, dtype=torch.int64, device=device),
                           torch.empty(num_rows, dtype=torch.int64, device=device),
                           torch.empty(num_rows, dtype=torch.float32, device=device),
                           torch.empty(num_rows, dtype=torch.float32, device=device))
    if num_rows == 0:
        return out
    if launch is None:
        launch = plan_sampler_launch(num_rows, vocab_size, multiprocessor_count(device))
    block_v, chunk_size, num_chunks = chunk_layout(vocab_size, launch)
    # The stats of every part, then every part's top-1 logit; two indices a part (top-1, best Gumbel score).
    part_stats = torch.empty(num_rows * num_chunks * (NUM_STATS + 1), dtype=torch.float32, device=device)
    part_index = torch.empty(num_rows, num_chunks, 2, dtype=torch.int32, device=device)
    cap = 1.0 if softcap is None else float(softcap)
    _canvas_stats_kernel[(num_rows, num_chunks)](
        logits, temperature, keys, part_stats, part_index, logits.stride(0), vocab_size, chunk_size, cap,
        BLOCK_V=block_v, SOFTCAP=softcap is not None, STATS=NUM_STATS, num_warps=launch.num_warps,
    )
    _canvas_merge_kernel[(num_rows,)](
        part_stats, part_index, out.sampled, out.argmax, out.entropy, out.logsumexp, num_rows, num_chunks,
        CHUNKS=triton.next_power_of_2(num_chunks), STATS=NUM_STATS,
    )
    return out


def canvas_probs_(logits: torch.Tensor, temperature: torch.Tensor, logsumexp: torch.Tensor,
                  softcap: float | None) -> torch.Tensor:
    """softmax(softcap(logits) / temperature) per row, written over `logits` (in their dtype) and returned."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    cap = 1.0 if softcap is None else float(softcap)
    _canvas_probs_kernel[(num_rows, triton.cdiv(vocab_size, PROBS_BLOCK))](
        logits, temperature, logsumexp, logits.stride(0), vocab_size, cap,
        BLOCK_V=PROBS_BLOCK, SOFTCAP=softcap is not None, num_warps=8,
    )
    return logits
