"""The one-launch acceptance kernel keeps exactly the tokens the torch rule keeps."""
from __future__ import annotations

import itertools

import pytest
import torch

from diffulex_backend.acceptance import AcceptanceBatch, AcceptanceRule
from diffulex_backend.sampling import SamplingMode
from kernel_cases import DEVICE, FULL_SHAPES, generator

MASK = 7
VOCAB = 50


def make_batch(lengths: list[int], seed: int, *, ties: bool, accept: float = 0.6, remask: float = 0.3,
               logit_dtype: torch.dtype = torch.bfloat16) -> AcceptanceBatch:
    """Random segments of the given lengths: about half the positions masked, flags and thresholds per segment."""
    gen = generator(seed)
    num_positions, num_segs = sum(lengths), len(lengths)

    def uniform(n: int) -> torch.Tensor:
        return torch.rand(n, generator=gen, device=DEVICE)

    current = torch.randint(0, VOCAB, (num_positions,), generator=gen, device=DEVICE)
    current[uniform(num_positions) < 0.5] = MASK
    predicted = torch.randint(0, VOCAB, (num_positions,), generator=gen, device=DEVICE)
    predicted[predicted == MASK] = MASK + 1
    confidence = uniform(num_positions)
    if ties:  # a few distinct values, so ranks must break ties by position as the stable sort does
        confidence = (confidence * 4).floor() / 4
    logsumexp = uniform(num_positions) * 2
    current_logit = (logsumexp + torch.log(uniform(num_positions))).to(logit_dtype)
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(num_segs + 1, dtype=torch.int64, device=DEVICE)
    offsets[1:] = lengths_t.cumsum(0)
    return AcceptanceBatch(
        current=current, predicted=predicted, confidence=confidence, current_logit=current_logit,
        logsumexp=logsumexp, seg_offsets=offsets, max_segment_len=max(lengths, default=0),
        seg_first=uniform(num_segs) < 0.5, seg_enabled=uniform(num_segs) < 0.8,
        seg_accept_threshold=torch.full((num_segs,), accept, device=DEVICE),
        seg_remask_threshold=torch.full((num_segs,), remask, device=DEVICE),
        seg_num_transfer=torch.randint(0, 6, (num_segs,), generator=gen, device=DEVICE),
    )


def sampler(mode: SamplingMode) -> AcceptanceRule:
    return AcceptanceRule(mode, MASK)


# Block-sized segments, ragged ones, one-position ones, and segments longer than a kernel tile (32 positions).
LENGTHS = {
    "blocks of 32": [32] * (64 if FULL_SHAPES else 6),
    "ragged": [5, 32, 1, 17, 32, 3],
    "longer than a tile": [100, 33, 64, 7],
    "one segment": [4],
}


@pytest.mark.parametrize("mode", list(SamplingMode))
@pytest.mark.parametrize(("name", "ties"), list(itertools.product(LENGTHS, [False, True])))
def test_kernel_keeps_the_reference_tokens(mode, name, ties):
    accepted = still_masked = 0
    for seed in range(4):
        batch = make_batch(LENGTHS[name], seed, ties=ties)
        want = sampler(mode)(batch)
        got = sampler(mode)(batch, use_kernel=True)
        assert torch.equal(got, want), (mode, name, seed)
        masked = batch.current == MASK
        accepted += int((masked & (want != MASK)).sum())
        still_masked += int((masked & (want == MASK)).sum())
    # Not a trivial case: the steps accepted some masked positions and left others masked.
    assert accepted > 0 and still_masked > 0


def test_first_block_takes_its_best_position_when_none_clears_the_threshold():
    batch = make_batch([32, 32], seed=5, ties=True, accept=2.0)  # no confidence reaches 2
    batch.seg_first[:] = torch.tensor([True, False], device=DEVICE)
    batch.seg_enabled[:] = True
    got = sampler(SamplingMode.THRESHOLD)(batch, use_kernel=True)
    assert torch.equal(got, sampler(SamplingMode.THRESHOLD)(batch))
    accepted = (got != batch.current) & (batch.current == MASK)
    assert int(accepted[:32].sum()) == 1 and int(accepted[32:].sum()) == 0
    masked = torch.nonzero(batch.current[:32] == MASK).flatten()
    best = masked[torch.argmax(batch.confidence[masked])]  # argmax returns the first maximum: the lower index
    assert bool(accepted[best])


def test_remasking_spares_the_first_block_and_respects_the_threshold():
    batch = make_batch([16, 16], seed=6, ties=False, accept=2.0, remask=0.5)
    batch.seg_first[:] = torch.tensor([True, False], device=DEVICE)
    batch.seg_enabled[:] = False  # nothing accepted: only remasking changes tokens
    got = sampler(SamplingMode.THRESHOLD)(batch, use_kernel=True)
    assert torch.equal(got, sampler(SamplingMode.THRESHOLD)(batch))
    prob = torch.exp(batch.current_logit.float() - batch.logsumexp)
    filled = batch.current != MASK
    assert torch.equal(got[:16], batch.current[:16])
    expect_remasked = filled[16:] & (prob[16:] < 0.5)
    assert bool(expect_remasked.any())
    assert torch.equal(got[16:] == MASK, ~filled[16:] | expect_remasked)


def test_no_segments():
    batch = make_batch([], seed=0, ties=False)
    assert sampler(SamplingMode.THRESHOLD)(batch, use_kernel=True).numel() == 0
