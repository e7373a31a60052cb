"""The fused sampler picks the reference's tokens and reports the reference's confidences; with the engine's
caller, rows with top-k/top-p follow the reference's filter, which is checked against hand-computed sets. Rows whose
logits are not finite are flagged alike by every path."""
from __future__ import annotations

import math

import pytest
import torch

import diffulex_kernels
from diffulex_backend.runner import finite_flags, sample
from diffulex_backend.sampling import Confidence, _filter_top_k_top_p, row_keys, sample_reference
from diffulex_kernels import sampling as kernel_sampling
from diffulex_kernels.sampling import SamplerLaunch, SamplerOutput, chunk_layout, compiled_variant, plan_sampler_launch
from kernel_cases import DEVICE, FULL_SHAPES, generator, randn

# Vocabularies that are not a multiple of the kernel's tile, so the last tile is ragged.
VOCABS = [126464, 152064] if FULL_SHAPES else [5000, 1000]
NUM_ROWS = 64 if FULL_SHAPES else 12


def poisoned_result(num_rows: int) -> SamplerOutput:
    return SamplerOutput(
        tokens=torch.full((num_rows,), -7, dtype=torch.int64, device=DEVICE),
        confidence=torch.full((num_rows,), float("nan"), device=DEVICE),
        logsumexp=torch.full((num_rows,), float("nan"), device=DEVICE),
    )


def cycled(values: list, num_rows: int) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE).repeat(num_rows // len(values) + 1)[:num_rows]


def make_rows(num_rows: int, vocab: int, dtype: torch.dtype, seed: int):
    gen = generator(seed)
    logits = (randn(num_rows, vocab, dtype=torch.float32, gen=gen) * 3).to(dtype)
    # Every other row samples, at a few temperatures; the rest are greedy.
    temperature = cycled([0.0, 0.7, 0.0, 1.0, 0.0, 1.6], num_rows)
    steps = torch.arange(num_rows, device=DEVICE)
    keys = row_keys(torch.full((num_rows,), seed, device=DEVICE), steps * 3 + 1, steps)
    kinds = cycled([int(k) for k in Confidence], num_rows)
    return logits, temperature, keys, kinds


def run_kernel(*args, **kwargs) -> SamplerOutput:
    return diffulex_kernels.sample_and_confidence(*args, **kwargs, out=poisoned_result(args[0].shape[0]))


def assert_same_result(out, ref) -> None:
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.confidence, ref.confidence, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.logsumexp, ref.logsumexp, rtol=1e-5, atol=1e-5)


# One program per row, at two tile widths, and each row cut into three chunks merged by a second kernel (the
# planner's choice with fewer rows than multiprocessors). 512-entry tiles give every vocabulary here at least two
# chunks, the last one ragged.
CHUNKED = SamplerLaunch(block_v=512, num_warps=4, num_chunks=3)
LAUNCHES = [SamplerLaunch(block_v=8192, num_warps=8), SamplerLaunch(block_v=4096, num_warps=4), CHUNKED]


def launch_id(launch: SamplerLaunch) -> str:
    return f"tile{launch.block_v}" + (f"x{launch.num_chunks}chunks" if launch.num_chunks > 1 else "")


@pytest.mark.parametrize("launch", LAUNCHES, ids=launch_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
def test_tokens_and_confidences_match_reference(vocab, dtype, launch):
    logits, temperature, keys, kinds = make_rows(NUM_ROWS, vocab, dtype, seed=vocab)
    out = run_kernel(logits, temperature, keys, kinds, launch=launch)
    assert_same_result(out, sample_reference(logits, temperature, keys, kinds))


def test_sampled_rows_draw_different_tokens_than_greedy():
    # Guards the Gumbel path itself: at a high temperature the draws must not collapse onto the argmax.
    logits, _, keys, kinds = make_rows(NUM_ROWS, VOCABS[0], torch.float32, seed=3)
    temperature = torch.full((NUM_ROWS,), 5.0, device=DEVICE)
    out = run_kernel(logits, temperature, keys, kinds)
    assert torch.equal(out.tokens, sample_reference(logits, temperature, keys, kinds).tokens)
    assert (out.tokens != logits.argmax(-1)).sum() > NUM_ROWS // 2


@pytest.mark.parametrize("launch", [None, CHUNKED], ids=["default", "chunked"])
def test_ties_take_the_first_index_and_give_zero_margin(launch):
    vocab = VOCABS[0]
    logits, _, keys, _ = make_rows(2, vocab, torch.float32, seed=9)
    # The maximum appears twice, in different vocabulary tiles (and chunks).
    logits[:, [17, vocab - 3]] = logits.max() + 1.0
    temperature = torch.zeros(2, device=DEVICE)
    kinds = torch.tensor([int(Confidence.PROB), int(Confidence.MARGIN)], device=DEVICE)
    out = run_kernel(logits, temperature, keys, kinds, launch=launch)
    assert out.tokens.tolist() == [17, 17]
    assert out.confidence[1].item() == 0.0
    assert_same_result(out, sample_reference(logits, temperature, keys, kinds))


def test_confidence_kinds_are_the_engines():
    assert kernel_sampling.CONFIDENCE_PROB == Confidence.PROB
    assert kernel_sampling.CONFIDENCE_MARGIN == Confidence.MARGIN
    assert kernel_sampling.CONFIDENCE_NEG_ENTROPY == Confidence.NEG_ENTROPY


def test_kernel_with_the_runners_top_k_top_p_rows_matches_the_reference():
    logits, temperature, keys, kinds = make_rows(NUM_ROWS, VOCABS[1], torch.float32, seed=4)
    temperature = torch.where(temperature > 0, 5.0, 0.0)  # hot enough that the filter changes the draws
    top_k = cycled([0, 1, 0, 5], NUM_ROWS)
    top_p = cycled([0.8, 1.0, 1.0], NUM_ROWS)
    out = sample(logits, temperature, keys, kinds, top_k, top_p, use_kernel=True, filtered=True)
    assert_same_result(out, sample_reference(logits, temperature, keys, kinds, top_k, top_p))
    # The filtered rows were rewritten: the kernel alone, which ignores top-k/top-p, draws other tokens there.
    filtered_rows = ((top_k > 0) | (top_p < 1)) & (temperature > 0)
    unfiltered = run_kernel(logits, temperature, keys, kinds)
    assert (out.tokens != unfiltered.tokens)[filtered_rows].any()
    assert torch.equal(out.tokens[~filtered_rows], unfiltered.tokens[~filtered_rows])


# Probabilities that are powers of two, so the softmax and its cumulative sums are exact and a top-p can land
# exactly on a boundary: by index 0.125, 0.5, 0.0625, 0.25, 0.0625 (indices 2 and 4 tie). In descending order
# 1, 3, 0, then 2 and 4; the mass strictly ahead of each is 0, 0.5, 0.75, 0.875, 0.9375.
FILTER_LOGITS = -math.log(2) * torch.tensor([2.0, 0.0, 3.0, 1.0, 3.0])
TIED = {2, 4}
# (top_k, top_p) -> (indices certainly kept, how many of the tied pair are kept)
FILTER_CASES = {
    (0, 1.0): ({0, 1, 3}, 2),  # both off
    (1, 1.0): ({1}, 0),
    (2, 1.0): ({1, 3}, 0),
    (3, 1.0): ({0, 1, 3}, 0),
    (4, 1.0): ({0, 1, 3}, 1),  # k cuts between the tied pair: one of them stays
    (9, 1.0): ({0, 1, 3}, 2),  # k beyond the vocabulary
    (0, 0.01): ({1}, 0),  # the top token always stays
    (0, 0.5): ({1}, 0),  # exactly on a boundary: a token whose mass ahead reaches p is dropped
    (0, 0.51): ({1, 3}, 0),
    (0, 0.75): ({1, 3}, 0),  # on a boundary
    (0, 0.875): ({0, 1, 3}, 0),  # on a boundary, in front of the tied pair
    (0, 0.9): ({0, 1, 3}, 1),  # between the tied pair
    (0, 0.95): ({0, 1, 3}, 2),
    (2, 0.9): ({1, 3}, 0),
    # top-p measures the mass after top-k: among the top 2 the second is ahead by 2/3 >= 0.6, so it is dropped,
    # though over the whole vocabulary only 0.5 is ahead of it.
    (2, 0.6): ({1}, 0),
}


def test_top_k_top_p_filter_keeps_the_hand_computed_sets():
    cases = list(FILTER_CASES)
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases], dtype=torch.float32)
    filtered = _filter_top_k_top_p(FILTER_LOGITS.repeat(len(cases), 1), top_k, top_p)
    for (k, p), row in zip(cases, filtered):
        kept = set(torch.isfinite(row).nonzero().flatten().tolist())
        certain, num_tied = FILTER_CASES[k, p]
        assert kept - TIED == certain and len(kept & TIED) == num_tied, (k, p, kept)
        assert torch.equal(row[list(kept)], FILTER_LOGITS[list(kept)])  # kept logits are left as they were


@pytest.mark.parametrize("launch", [None, CHUNKED], ids=["default", "chunked"])
def test_confidences_match_when_the_peak_is_in_the_last_tile(launch):
    # The running statistics are rescaled whenever a later vocabulary tile (or chunk) raises the maximum.
    vocab = VOCABS[0]
    logits, temperature, keys, _ = make_rows(3, vocab, torch.float32, seed=6)
    logits[:, vocab - 5] = logits.max() + 2.0
    kinds = torch.tensor([int(k) for k in Confidence], device=DEVICE)
    out = run_kernel(logits, temperature, keys, kinds, launch=launch)
    assert_same_result(out, sample_reference(logits, temperature, keys, kinds))


@pytest.mark.parametrize("vocab", [126464, 152064])
def test_few_rows_are_cut_into_chunks_that_fill_the_gpu(vocab):
    # An H100's 132 multiprocessors: below that many rows each row is cut into chunks so that the programs cover
    # the GPU, and the compiled variants stay few (each one is compiled before serving).
    num_sms, tiles = 132, -(-vocab // 4096)
    launches = {rows: plan_sampler_launch(rows, vocab, num_sms) for rows in range(1, 400)}
    chunks = {rows: chunk_layout(vocab, launch)[2] for rows, launch in launches.items()}
    assert all(chunks[rows] == 1 for rows in launches if rows >= num_sms)
    assert all(rows * chunks[rows] >= num_sms or chunks[rows] == tiles for rows in launches if rows < num_sms)
    assert len({compiled_variant(vocab, launch) for launch in launches.values()}) <= 7


def shard_merge(logits: torch.Tensor, current: torch.Tensor, kinds: torch.Tensor, ranks: int, mask: int):
    """What `greedy_over_shards` computes on CUDA: each rank's shard_stats over its share (the last one padded
    past the vocabulary with rows no id reaches), stacked as the all-gather stacks them, then merged."""
    vocab = logits.shape[1]
    columns = -(-vocab // ranks)
    padded = torch.cat([logits, torch.full((logits.shape[0], columns * ranks - vocab), 7.0, device=DEVICE,
                                           dtype=logits.dtype)], dim=1)  # padding above every logit: it must not count
    parts = []
    for rank in range(ranks):
        start = rank * columns
        held = min(columns, vocab - start)
        mask_column = mask - start if 0 <= mask - start < held else -1
        parts.append(kernel_sampling.shard_stats(padded[:, start:start + columns].contiguous(), current, start, held,
                                                 mask_column))
    return kernel_sampling.merge_shard_stats(torch.cat(parts), kinds, ranks)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_greedy_rows_merged_over_ranks_shares_match_the_reference_on_whole_rows(ranks, dtype):
    vocab = VOCABS[0] if FULL_SHAPES else 1001
    logits = (randn(NUM_ROWS, vocab, dtype=torch.float32, gen=generator(ranks)) * 3).to(dtype)
    mask = vocab // 2 + 3
    # Ties across a rank's boundary and within a rank: the lower id wins, as argmax over the whole row does.
    boundary = -(-vocab // ranks) if ranks > 1 else vocab // 3  # rank 1's first id
    logits[0, [boundary - 1, boundary, vocab - 1]] = 50
    logits[1, [5, 9]] = 50
    logits[2, mask] = 60  # the mask token's logit is the row's largest, and never chosen
    gen = generator(ranks + 100)
    current = torch.randint(0, vocab, (NUM_ROWS,), generator=gen, device=DEVICE)
    current[:3] = mask
    current[3] = vocab - 1
    kinds = cycled([int(k) for k in Confidence], NUM_ROWS)
    out, current_logit = shard_merge(logits, current, kinds, ranks, mask)

    whole = logits.float().clone()
    whole[:, mask] = float("-inf")
    zeros = torch.zeros(NUM_ROWS, device=DEVICE)
    ref = sample_reference(whole, zeros, zeros.long(), kinds)
    assert_same_result(out, ref)
    assert out.tokens[0] == boundary - 1 and out.tokens[1] == 5 and out.tokens[2] != mask
    assert torch.equal(current_logit, whole.gather(1, current[:, None]).squeeze(1))  # -inf for the mask token


def rows_with_non_finite_logits(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """Random rows, some of them poisoned, and the finite flag each should get: a row with a NaN, with a +inf, or -inf
    throughout (nothing could be sampled) is not finite; one with a -inf among finite values (a banned token) is."""
    logits, _, _, _ = make_rows(NUM_ROWS, vocab, dtype, seed=21)
    logits[1, vocab - 2] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    logits[4, 11] = float("-inf")
    return logits, [1, 0, 0, 0] + [1] * (NUM_ROWS - 4)


@pytest.mark.parametrize("launch", [None, CHUNKED], ids=["default", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_whose_logits_are_not_finite_are_flagged_by_the_kernel_as_by_the_reference(dtype, launch):
    logits, expected = rows_with_non_finite_logits(VOCABS[1], dtype)
    _, temperature, keys, kinds = make_rows(NUM_ROWS, VOCABS[1], dtype, seed=21)
    out = run_kernel(logits, temperature, keys, kinds, launch=launch)
    assert finite_flags(out).tolist() == expected
    assert finite_flags(sample_reference(logits, temperature, keys, kinds)).tolist() == expected


@pytest.mark.parametrize("ranks", [1, 3])
def test_rows_whose_logits_are_not_finite_are_flagged_when_merged_over_ranks_shares(ranks):
    logits, expected = rows_with_non_finite_logits(1001, torch.float32)
    kinds = cycled([int(k) for k in Confidence], NUM_ROWS)
    out, _ = shard_merge(logits, torch.zeros(NUM_ROWS, dtype=torch.int64, device=DEVICE), kinds, ranks, mask=500)
    assert finite_flags(out).tolist() == expected


def test_shard_chunks_depend_on_the_sizes_alone():
    """Every rank cuts its share into as many chunks, whatever its device, for the all-gather between them."""
    assert kernel_sampling.shard_launch(1, 63232) == (4096, 4096, 16)
    assert kernel_sampling.shard_launch(32, 63232) == (4096, 8192, 8)
    assert kernel_sampling.shard_launch(512, 63232)[2] == 1
    stats = kernel_sampling.shard_stats(torch.zeros(3, 9000, device=DEVICE), torch.zeros(3, dtype=torch.int64,
                                                                                           device=DEVICE), 0, 9000, -1)
    assert stats.shape == (3, kernel_sampling.shard_launch(3, 9000)[2], kernel_sampling.NUM_SHARD_STATS)


def test_a_rank_s_share_cut_into_several_chunks_merges_as_one():
    """Few rows over a share wider than one tile: each rank's share in several chunks, merged across chunks and
    ranks in vocabulary order, with a tie across a chunk's edge."""
    vocab, ranks, rows = 20000, 2, 4
    columns = -(-vocab // ranks)
    assert kernel_sampling.shard_launch(rows, columns)[2] > 1
    logits = randn(rows, vocab, dtype=torch.float32, gen=generator(5)) * 3
    logits[0, [4095, 4096]] = 40  # a tie across rank 0's first chunk edge
    current = torch.arange(rows, device=DEVICE) * 4001
    kinds = cycled([int(k) for k in Confidence], rows)
    mask = 7
    out, current_logit = shard_merge(logits, current, kinds, ranks, mask)
    whole = logits.clone()
    whole[:, mask] = float("-inf")
    zeros = torch.zeros(rows, device=DEVICE)
    assert_same_result(out, sample_reference(whole, zeros, zeros.long(), kinds))
    assert out.tokens[0] == 4095
    assert torch.equal(current_logit, whole.gather(1, current[:, None]).squeeze(1))


def test_compiling_the_shard_launches_ahead_runs_each_chunk_count():
    kernel_sampling.compile_shard_launches(9000, 9000, 8999, 3, 2, torch.float32, DEVICE)
