"""Fused sampling and confidence: the kernel twin of `diffulex_backend.sampling.sample_reference`.

A program streams a row's logits once, in vocabulary tiles, and keeps running statistics: the max and sum of
exponentials (online softmax, base 2), the top-2 logits with the first argmax, the entropy accumulator, and for
sampled rows the Gumbel-max candidate. The softmax over the vocabulary is never written out. The Gumbel noise is
the reference's counter hash of (row key, vocab index), so the kernel draws the same token as the reference; only
a near-tie within float rounding of the tempered scores may differ.

With fewer rows than multiprocessors, one program per row would leave most of the GPU idle, so each row's
vocabulary is cut into chunks: a program per (row, chunk) writes its statistics, and a second kernel merges a
row's chunks in vocabulary order, which keeps the first-index tie rule.

In its tempered form (DiffusionGemma's sampler, `canvas_sampling.py`) the kernel reads a row's raw logits and forms
its scores, soft-capped and over the temperature, in registers; every statistic is then of those scores.

Top-k and top-p need the vocabulary sorted, which one streaming pass cannot do: this module ignores them, and the
engine's caller (`sample` in `diffulex_backend/runner.py`) recomputes the rows that ask for them with the reference
and writes them over the kernel's answer. The module imports nothing from the engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .device import multiprocessor_count

# The confidence kinds a row asks for: the values of the engine's `Confidence` IntEnum
# (diffulex_backend/sampling.py), which tests/kernels/test_sampling.py checks.
CONFIDENCE_PROB = 0  # probability of the chosen token
CONFIDENCE_MARGIN = 1  # top-1 minus top-2 probability
CONFIDENCE_NEG_ENTROPY = 2  # sum p log p

LOG2_E = tl.constexpr(1.4426950408889634)
LN_2 = tl.constexpr(0.6931471805599453)
PROB = tl.constexpr(CONFIDENCE_PROB)
MARGIN = tl.constexpr(CONFIDENCE_MARGIN)
# The running statistics of a (row, chunk), in the order of the partials' last dimension.
NUM_STATS = 6  # base-2 max, sum of exponentials, entropy accumulator, top-1, top-2, best Gumbel score
MAX_CHUNKS = 64  # the merge holds every chunk of a row in registers


class SamplerOutput(NamedTuple):
    """The fields of the engine's `SampleResult`, in its order."""

    tokens: torch.Tensor  # [N] int64: the sampled (or greedy) token
    confidence: torch.Tensor  # [N] float32: the row's confidence measure, on the untempered distribution
    logsumexp: torch.Tensor  # [N] float32: p(t) = exp(logit_t - logsumexp)


def empty_output(num_rows: int, device: torch.device) -> SamplerOutput:
    return SamplerOutput(tokens=torch.empty(num_rows, dtype=torch.int64, device=device),
                         confidence=torch.empty(num_rows, dtype=torch.float32, device=device),
                         logsumexp=torch.empty(num_rows, dtype=torch.float32, device=device))


@dataclass(frozen=True)
class SamplerLaunch:
    block_v: int  # vocabulary entries per loop step
    num_warps: int
    num_chunks: int = 1  # programs per row; above 1, a merge kernel combines their statistics


def plan_sampler_launch(num_rows: int, vocab_size: int, num_sms: int) -> SamplerLaunch:
    """Measured on the H100 over a 126k vocabulary (`benchmarks/kernels.py --sections sampler_sweep`): 4096-entry
    tiles on 4 warps, and with fewer rows than multiprocessors each row cut into chunks so that about two programs
    run on every multiprocessor."""
    one_per_row = SamplerLaunch(block_v=4096, num_warps=4)
    if num_rows >= num_sms:
        return one_per_row
    tiles = triton.cdiv(vocab_size, one_per_row.block_v)
    return dataclasses.replace(one_per_row, num_chunks=min(tiles, MAX_CHUNKS, triton.cdiv(2 * num_sms, num_rows)))


def chunk_layout(vocab_size: int, launch: SamplerLaunch) -> tuple[int, int, int]:
    """(tile width, entries per chunk, chunks) of a launch over this vocabulary: whole tiles per chunk, and no empty
    chunk, so the chunk count is recomputed from the tiles each chunk gets."""
    block_v = min(launch.block_v, triton.next_power_of_2(vocab_size))
    tiles_per_chunk = triton.cdiv(triton.cdiv(vocab_size, block_v), min(launch.num_chunks, MAX_CHUNKS))
    chunk_size = tiles_per_chunk * block_v
    return block_v, chunk_size, triton.cdiv(vocab_size, chunk_size)


def compiled_variant(vocab_size: int, launch: SamplerLaunch) -> tuple[int, int, int]:
    """What Triton compiles a launch into: its tile and warps, and the merge's width (a power of two of chunks;
    the chunk count itself is a runtime argument)."""
    block_v, _, num_chunks = chunk_layout(vocab_size, launch)
    return block_v, launch.num_warps, triton.next_power_of_2(num_chunks)


def compile_launches(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Runs the launches `plan_sampler_launch` picks for this vocabulary once per compiled variant, so that none is
    compiled while requests wait."""
    num_sms = multiprocessor_count(device)
    rows_of_variant = {compiled_variant(vocab_size, plan_sampler_launch(rows, vocab_size, num_sms)): rows
                       for rows in range(num_sms, 0, -1)}
    for rows in rows_of_variant.values():
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        sample_and_confidence(torch.zeros(rows, vocab_size, dtype=dtype, device=device),
                              torch.zeros(rows, device=device), zeros, zeros)


@triton.jit
def _mix32(x):
    """murmur3's fmix32 on uint32 (the products wrap mod 2^32)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _confidence(kind, token_logit, top1, top2, run_max, run_sum, run_ent):
    """A row's confidence measure of the kind it asks for, and its logsumexp, from its whole-vocabulary statistics."""
    lse2 = run_max + tl.log2(run_sum)
    prob = tl.exp2(token_logit * LOG2_E - lse2)
    margin = tl.exp2(top1 * LOG2_E - lse2) - tl.exp2(top2 * LOG2_E - lse2)
    neg_entropy = LN_2 * (run_ent / run_sum - tl.log2(run_sum))
    confidence = tl.where(kind == PROB, prob, tl.where(kind == MARGIN, margin, neg_entropy))
    return confidence, lse2 * LN_2


@triton.jit
def _scores(x, cap, temperature, SOFTCAP: tl.constexpr):
    """Tempered scores cap tanh(x / cap) / T (x / T without SOFTCAP) in float32; tanh as 2 sigmoid(2y) - 1, which
    saturates to +-1 where exp overflows (its error, about 1e-7 of the cap, is far below one rounding of a bf16
    logit)."""
    x = x.to(tl.float32)
    if SOFTCAP:
        x = cap * (2.0 / (1.0 + tl.exp(-2.0 * tl.math.div_rn(x, cap))) - 1.0)
    return tl.math.div_rn(x, temperature)


@triton.jit
def _finish_row(
    row, row_ptr, kind_ptr, tokens_ptr, confidence_ptr, logsumexp_ptr, argmax_ptr,
    run_max, run_sum, run_ent, top1, top2, token, top1_index, cap, temperature,
    TEMPERED: tl.constexpr, SOFTCAP: tl.constexpr, ARGMAX: tl.constexpr,
):
    """The row's confidence measure and logsumexp from its whole-vocabulary statistics, its token, and with ARGMAX
    its first argmax."""
    token_logit = tl.load(row_ptr + token).to(tl.float32)
    if TEMPERED:
        token_logit = _scores(token_logit, cap, temperature, SOFTCAP)
    if ARGMAX:
        tl.store(argmax_ptr + row, top1_index.to(tl.int64))
    confidence, logsumexp = _confidence(tl.load(kind_ptr + row), token_logit, top1, top2, run_max, run_sum, run_ent)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(confidence_ptr + row, confidence)
    tl.store(logsumexp_ptr + row, logsumexp)


@triton.jit
def _add_tile(x, offsets, start, run_max, run_sum, run_ent, top1, top1_index, top2):
    """The running statistics after one more tile `x` of a row (entries start + offsets): the online softmax in
    base 2 with its entropy accumulator, and the top-2 logits with the first argmax."""
    tile_top1, tile_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tile_top2 = tl.max(tl.where(offsets == tile_arg, float("-inf"), x), axis=0)
    top2 = tl.maximum(tl.maximum(top2, tile_top2), tl.minimum(top1, tile_top1))
    top1_index = tl.where(tile_top1 > top1, start + tile_arg, top1_index)  # strict: the first max wins
    top1 = tl.maximum(top1, tile_top1)

    y = x * LOG2_E
    new_max = tl.maximum(run_max, tile_top1 * LOG2_E)
    alpha = tl.exp2(run_max - new_max)
    p = tl.exp2(y - new_max)
    # Shifting the reference point of the entropy terms by (run_max - new_max) adds that times the sum.
    run_ent = alpha * (run_ent + (run_max - new_max) * run_sum) + tl.sum(tl.where(p > 0, p * (y - new_max), 0.0), axis=0)
    run_sum = run_sum * alpha + tl.sum(p, axis=0)
    return new_max, run_sum, run_ent, top1, top1_index, top2


@triton.jit
def _merge_parts(part_max, part_sum, part_ent, part_top1, part_top2, parts):
    """A row's statistics from those of its parts (chunks of its vocabulary, in vocabulary order), as one program's
    loop over them would find; with the part that holds the first maximum."""
    run_max = tl.max(part_max, axis=0)
    weight = tl.exp2(part_max - run_max)
    run_sum = tl.sum(part_sum * weight, axis=0)
    run_ent = tl.sum(weight * (part_ent + (part_max - run_max) * part_sum), axis=0)
    # Ties go to the earliest part, as they go to the earliest tile inside one.
    top1, top1_part = tl.max(part_top1, axis=0, return_indices=True, return_indices_tie_break_left=True)
    top2 = tl.maximum(tl.max(part_top2, axis=0), tl.max(tl.where(parts == top1_part, float("-inf"), part_top1), axis=0))
    return run_max, run_sum, run_ent, top1, top1_part, top2


@triton.jit
def _sample_and_confidence_kernel(
    logits_ptr, temperature_ptr, keys_ptr, kind_ptr,
    tokens_ptr, confidence_ptr, logsumexp_ptr, argmax_ptr, part_stats_ptr, part_index_ptr,
    stride_row, vocab_size, chunk_size, cap,
    BLOCK_V: tl.constexpr, CHUNKED: tl.constexpr, STATS: tl.constexpr,
    TEMPERED: tl.constexpr, SOFTCAP: tl.constexpr, ARGMAX: tl.constexpr,
):
    """TEMPERED: every statistic is of the row's tempered scores (`_scores`), formed here from its raw logits, and
    the Gumbel score is those scores plus the noise; else of the logits themselves, with the noise added to x / T."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chunk_begin = chunk * chunk_size
    chunk_end = tl.minimum(vocab_size, chunk_begin + chunk_size)
    temperature = tl.load(temperature_ptr + row)
    sampled = temperature > 0
    key = tl.load(keys_ptr + row).to(tl.uint32)
    offsets = tl.arange(0, BLOCK_V)
    # The next tile is requested before the current one is reduced, so a load is always in flight.
    next_tile = tl.load(row_ptr + chunk_begin + offsets, mask=chunk_begin + offsets < chunk_end, other=float("-inf"))

    run_max = -1.0e30  # base-2 running max; finite so that the first rescale is exp2(-huge) = 0, not NaN
    run_sum = 0.0  # sum of 2^(y - run_max)
    run_ent = 0.0  # sum of 2^(y - run_max) * (y - run_max), for sum p log p
    top1 = float("-inf")
    top1_index = 0
    top2 = float("-inf")
    best_score = float("-inf")
    best_index = 0
    for start in range(chunk_begin, chunk_end, BLOCK_V):
        index = start + offsets
        valid = index < chunk_end
        x = next_tile.to(tl.float32)  # [BLOCK_V]
        next_tile = tl.load(row_ptr + BLOCK_V + index, mask=index + BLOCK_V < chunk_end, other=float("-inf"))
        if TEMPERED:  # past the vocabulary stays -inf: the soft cap would bound it
            x = tl.where(valid, _scores(x, cap, temperature, SOFTCAP), float("-inf"))

        run_max, run_sum, run_ent, top1, top1_index, top2 = _add_tile(
            x, offsets, start, run_max, run_sum, run_ent, top1, top1_index, top2)

        if sampled:
            noise_hash = _mix32(key ^ _mix32(index.to(tl.uint32)))
            uniform = ((noise_hash >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact in float32, < 1
            gumbel = -tl.log(-tl.log(uniform))
            if TEMPERED:
                score = tl.where(valid, x + gumbel, float("-inf"))
            else:
                score = tl.where(valid, tl.math.div_rn(x, temperature) + gumbel, float("-inf"))
            tile_best, tile_best_arg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best_index = tl.where(tile_best > best_score, start + tile_best_arg, best_index)
            best_score = tl.maximum(best_score, tile_best)

    if CHUNKED:
        # Partials are [rows, chunks, STATS] float32 and [rows, chunks, 2] int32; the merge kernel reads them.
        part = row * tl.num_programs(1) + chunk
        stats_ptr = part_stats_ptr + part * STATS
        tl.store(stats_ptr + 0, run_max)
        tl.store(stats_ptr + 1, run_sum)
        tl.store(stats_ptr + 2, run_ent)
        tl.store(stats_ptr + 3, top1)
        tl.store(stats_ptr + 4, top2)
        tl.store(stats_ptr + 5, best_score)
        tl.store(part_index_ptr + part * 2, top1_index)
        tl.store(part_index_ptr + part * 2 + 1, best_index)
    else:
        token = tl.where(sampled, best_index, top1_index)
        _finish_row(row, row_ptr, kind_ptr, tokens_ptr, confidence_ptr, logsumexp_ptr, argmax_ptr,
                    run_max, run_sum, run_ent, top1, top2, token, top1_index, cap, temperature,
                    TEMPERED, SOFTCAP, ARGMAX)


@triton.jit(do_not_specialize=["num_chunks"])
def _merge_chunks_kernel(
    logits_ptr, temperature_ptr, kind_ptr, tokens_ptr, confidence_ptr, logsumexp_ptr, argmax_ptr,
    part_stats_ptr, part_index_ptr, stride_row, num_chunks, cap,
    CHUNKS: tl.constexpr, STATS: tl.constexpr, TEMPERED: tl.constexpr, SOFTCAP: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    """One program per row: every chunk's statistics in one load, combined as one program's loop would."""
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    stats_ptr = part_stats_ptr + (row * num_chunks + chunks) * STATS
    chunk_max = tl.load(stats_ptr + 0, mask=valid, other=-1.0e30)
    chunk_sum = tl.load(stats_ptr + 1, mask=valid, other=0.0)
    chunk_ent = tl.load(stats_ptr + 2, mask=valid, other=0.0)
    chunk_top1 = tl.load(stats_ptr + 3, mask=valid, other=float("-inf"))
    chunk_top2 = tl.load(stats_ptr + 4, mask=valid, other=float("-inf"))
    chunk_best = tl.load(stats_ptr + 5, mask=valid, other=float("-inf"))

    run_max, run_sum, run_ent, top1, top1_chunk, top2 = _merge_parts(
        chunk_max, chunk_sum, chunk_ent, chunk_top1, chunk_top2, chunks)
    _, best_chunk = tl.max(chunk_best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    temperature = tl.load(temperature_ptr + row)
    sampled = temperature > 0
    token_chunk = tl.where(sampled, best_chunk, top1_chunk)
    token = tl.load(part_index_ptr + (row * num_chunks + token_chunk) * 2 + tl.where(sampled, 1, 0))
    top1_index = tl.load(part_index_ptr + (row * num_chunks + top1_chunk) * 2)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    _finish_row(row, row_ptr, kind_ptr, tokens_ptr, confidence_ptr, logsumexp_ptr, argmax_ptr,
                run_max, run_sum, run_ent, top1, top2, token, top1_index, cap, temperature,
                TEMPERED, SOFTCAP, ARGMAX)


def sample_and_confidence(
    logits: torch.Tensor,  # [N, V] bf16/fp16/fp32
    temperature: torch.Tensor,  # [N] float32, 0 for greedy
    keys: torch.Tensor,  # [N] int64 noise keys (uint32 values), the engine's `row_keys`
    confidence_kind: torch.Tensor,  # [N] int64, one of the CONFIDENCE_* values
    *,
    out: SamplerOutput | None = None,  # preallocated outputs, e.g. a CUDA graph's static buffers
    launch: SamplerLaunch | None = None,  # default: plan_sampler_launch
    tempered: bool = False,
    softcap: float | None = None,
    argmax: torch.Tensor | None = None,  # [N] int64, written with each row's first argmax where given
) -> SamplerOutput:
    """The result of the engine's `sample_reference` without top-k/top-p: token, confidence, logsumexp.

    `tempered`: every row's scores are softcap(logits) / temperature (softcap(x) = cap tanh(x / cap), none where
    `softcap` is None), formed in registers from the raw logits, and token, confidence, logsumexp and argmax are those
    of the scores; every temperature must be above 0 (DiffusionGemma's sampler, kernels/canvas_sampling.py)."""
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("sample_and_confidence: logits need a contiguous vocabulary dimension")
    if out is None:
        out = empty_output(num_rows, logits.device)
    if num_rows == 0:
        return out
    if launch is None:
        launch = plan_sampler_launch(num_rows, vocab_size, multiprocessor_count(logits.device))
    block_v, chunk_size, num_chunks = chunk_layout(vocab_size, launch)
    chunked = num_chunks > 1
    part_stats = part_index = out.confidence  # unused placeholders when one program covers a row
    if chunked:
        part_stats = torch.empty(num_rows, num_chunks, NUM_STATS, dtype=torch.float32, device=logits.device)
        part_index = torch.empty(num_rows, num_chunks, 2, dtype=torch.int32, device=logits.device)
    scores = dict(TEMPERED=tempered, SOFTCAP=softcap is not None, ARGMAX=argmax is not None)
    cap = 1.0 if softcap is None else float(softcap)
    argmax = out.tokens if argmax is None else argmax  # a placeholder, not written, without ARGMAX
    _sample_and_confidence_kernel[(num_rows, num_chunks)](
        logits, temperature, keys, confidence_kind,
        out.tokens, out.confidence, out.logsumexp, argmax, part_stats, part_index,
        logits.stride(0), vocab_size, chunk_size, cap,
        BLOCK_V=block_v, CHUNKED=chunked, STATS=NUM_STATS, **scores, num_warps=launch.num_warps,
    )
    if chunked:
        _merge_chunks_kernel[(num_rows,)](
            logits, temperature, confidence_kind, out.tokens, out.confidence, out.logsumexp, argmax,
            part_stats, part_index, logits.stride(0), num_chunks, cap,
            CHUNKS=triton.next_power_of_2(num_chunks), STATS=NUM_STATS, **scores,
        )
    return out


# The statistics of one (row, chunk) of a rank's share of the vocabulary, in the order of shard_stats' last
# dimension: those a merge needs, the chunk's first argmax as a vocabulary id (a float: exact up to 2^24, far past
# any vocabulary), and the logit of the row's current token where the chunk holds it (0 elsewhere, so the merge sums).
NUM_SHARD_STATS = 7  # base-2 max, sum of exponentials, entropy accumulator, top-1, top-2, top-1 id, current logit
# Programs a shard_stats launch aims for: about two per multiprocessor of an H100 or H200 (132). A constant, not the
# device's count: every rank must cut its share into as many chunks for the all-gather between them.
SHARD_PROGRAMS = 256


def shard_launch(num_rows: int, columns: int) -> tuple[int, int, int]:
    """(tile width, entries per chunk, chunks) for rows of `columns` entries, from their sizes alone."""
    tiles = triton.cdiv(columns, 4096)
    launch = SamplerLaunch(block_v=4096, num_warps=4,
                           num_chunks=max(1, min(tiles, MAX_CHUNKS, triton.cdiv(SHARD_PROGRAMS, max(1, num_rows)))))
    return chunk_layout(columns, launch)


def compile_shard_launches(columns: int, vocab_start: int, held: int, mask_column: int, num_ranks: int,
                           dtype: torch.dtype, device: torch.device) -> None:
    """Runs shard_stats and merge_shard_stats once for every chunk count a step's rows can give, over this rank's
    share, so that no greedy step under tensor parallelism compiles one while requests wait."""
    rows_of_chunks = {shard_launch(rows, columns)[2]: rows for rows in range(SHARD_PROGRAMS, 0, -1)}
    for rows in rows_of_chunks.values():
        current = torch.full((rows,), vocab_start, dtype=torch.int64, device=device)
        stats = shard_stats(torch.zeros(rows, columns, dtype=dtype, device=device), current, vocab_start, held,
                            mask_column)
        merge_shard_stats(stats.repeat(num_ranks, 1, 1), torch.zeros(rows, dtype=torch.int64, device=device),
                          num_ranks)


@triton.jit
def _shard_stats_kernel(
    logits_ptr, current_ptr, stats_ptr, stride_row, held, chunk_size, vocab_start, mask_column,
    BLOCK_V: tl.constexpr, STATS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chunk_begin = chunk * chunk_size
    chunk_end = tl.minimum(held, chunk_begin + chunk_size)
    offsets = tl.arange(0, BLOCK_V)
    run_max = -1.0e30
    run_sum = 0.0
    run_ent = 0.0
    top1 = float("-inf")
    top1_index = 0
    top2 = float("-inf")
    for start in range(chunk_begin, chunk_end, BLOCK_V):
        index = start + offsets
        x = tl.load(row_ptr + index, mask=index < chunk_end, other=float("-inf")).to(tl.float32)
        x = tl.where(index == mask_column, float("-inf"), x)
        run_max, run_sum, run_ent, top1, top1_index, top2 = _add_tile(
            x, offsets, start, run_max, run_sum, run_ent, top1, top1_index, top2)
    current = tl.load(current_ptr + row) - vocab_start
    here = (current >= chunk_begin) & (current < chunk_end)
    current_logit = tl.load(row_ptr + current, mask=here, other=0.0).to(tl.float32)
    current_logit = tl.where(here & (current == mask_column), float("-inf"), current_logit)
    out = stats_ptr + (row * tl.num_programs(1) + chunk) * STATS
    tl.store(out + 0, run_max)
    tl.store(out + 1, run_sum)
    tl.store(out + 2, run_ent)
    tl.store(out + 3, top1)
    tl.store(out + 4, top2)
    tl.store(out + 5, (top1_index + vocab_start).to(tl.float32))
    tl.store(out + 6, current_logit)


@triton.jit(do_not_specialize=["num_rows", "num_parts"])
def _merge_shards_kernel(
    stats_ptr, kind_ptr, tokens_ptr, confidence_ptr, logsumexp_ptr, current_logit_ptr,
    num_rows, chunks_per_rank, num_parts,
    PARTS: tl.constexpr, STATS: tl.constexpr,
):
    """One program per row: every rank's chunks, in vocabulary order (rank by rank), combined into the row's token,
    confidence, logsumexp and current token's logit."""
    row = tl.program_id(0)
    parts = tl.arange(0, PARTS)
    valid = parts < num_parts
    rank = parts // chunks_per_rank
    ptr = stats_ptr + ((rank * num_rows + row) * chunks_per_rank + parts % chunks_per_rank) * STATS
    part_max = tl.load(ptr + 0, mask=valid, other=-1.0e30)
    part_sum = tl.load(ptr + 1, mask=valid, other=0.0)
    part_ent = tl.load(ptr + 2, mask=valid, other=0.0)
    part_top1 = tl.load(ptr + 3, mask=valid, other=float("-inf"))
    part_top2 = tl.load(ptr + 4, mask=valid, other=float("-inf"))
    part_index = tl.load(ptr + 5, mask=valid, other=0.0)
    part_current = tl.load(ptr + 6, mask=valid, other=0.0)
    run_max, run_sum, run_ent, top1, top1_part, top2 = _merge_parts(
        part_max, part_sum, part_ent, part_top1, part_top2, parts)
    token = tl.sum(tl.where(parts == top1_part, part_index, 0.0), axis=0)
    confidence, logsumexp = _confidence(tl.load(kind_ptr + row), top1, top1, top2, run_max, run_sum, run_ent)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(confidence_ptr + row, confidence)
    tl.store(logsumexp_ptr + row, logsumexp)
    tl.store(current_logit_ptr + row, tl.sum(part_current, axis=0))


def shard_stats(
    logits: torch.Tensor,  # [N, C]: one rank's columns of the vocabulary, from vocab_start
    current: torch.Tensor,  # [N] int64: each row's current token (a vocabulary id)
    vocab_start: int,
    held: int,  # columns that hold vocabulary entries; the rest are the last rank's padding
    mask_column: int,  # a column read as -inf (the mask token's), or -1
) -> torch.Tensor:
    """[N, chunks, NUM_SHARD_STATS] float32: a greedy row's statistics over this rank's share, for merge_shard_stats
    after an all-gather. The chunk count depends on N and C alone, the same on every rank."""
    num_rows, columns = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("shard_stats: logits need a contiguous vocabulary dimension")
    block_v, chunk_size, num_chunks = shard_launch(num_rows, columns)
    stats = torch.empty(num_rows, num_chunks, NUM_SHARD_STATS, dtype=torch.float32, device=logits.device)
    if num_rows:
        _shard_stats_kernel[(num_rows, num_chunks)](
            logits, current, stats, logits.stride(0), held, chunk_size, vocab_start, mask_column,
            BLOCK_V=block_v, STATS=NUM_SHARD_STATS, num_warps=4,
        )
    return stats


def merge_shard_stats(
    gathered: torch.Tensor,  # [ranks * N, chunks, NUM_SHARD_STATS]: every rank's shard_stats, rank 0's first
    confidence_kind: torch.Tensor,  # [N] int64, one of the CONFIDENCE_* values
    num_ranks: int,
) -> tuple[SamplerOutput, torch.Tensor]:
    """The greedy rows' token, confidence and logsumexp over the whole vocabulary, as sample_and_confidence gives
    them from whole rows, and [N] float32 the logit of each row's current token."""
    num_rows = gathered.shape[0] // num_ranks
    chunks = gathered.shape[1]
    out = empty_output(num_rows, gathered.device)
    current_logit = torch.empty(num_rows, dtype=torch.float32, device=gathered.device)
    if num_rows:
        _merge_shards_kernel[(num_rows,)](
            gathered, confidence_kind, out.tokens, out.confidence, out.logsumexp, current_logit,
            num_rows, chunks, num_ranks * chunks,
            PARTS=triton.next_power_of_2(num_ranks * chunks), STATS=NUM_SHARD_STATS,
        )
    return out, current_logit
