"""Each threshold changes decoding the way DESIGN.md says, from the config and, for accept and remask, from a
request's own SamplingParams."""
from __future__ import annotations

import torch

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID as MASK_ID
from engine_driver import Stream, run_requests, step_checked, tiny_engine

PROMPTS = ["hello world", "the quick brown fox", "ab", "diffusion"]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)  # 4 blocks of 4


def decode(path, prompts=PROMPTS, params=PARAMS, **config):
    streams = run_requests(tiny_engine(path, **config), prompts, params)
    return [s.token_ids for s in streams], [s.nfe for s in streams]


def trace(path, prompts=PROMPTS, params=PARAMS, **config):
    """Decode, and after every step take each request's generation area, cut into blocks, and the number of
    blocks each forward predicted per request. Returns (streams, snapshots, blocks_per_forward)."""
    llm = tiny_engine(path, **config)
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    rids = [llm.add_request(p, q) for p, q in zip(prompts, params_list)]
    reqs = [llm.requests[rid] for rid in rids]
    streams = {rid: Stream(rid) for rid in rids}
    snapshots, blocks_per_forward = [], []
    while llm.has_unfinished_requests():
        for delta in step_checked(llm):
            streams[delta.request_id].deltas.append(delta)
        blocks_per_forward += [len(p.blocks) for p in llm.last_schedule.plans]
        bs = llm.config.block_size
        snapshots.append([torch.tensor(r.tokens[r.num_prompt_tokens:]).view(-1, bs) for r in reqs])  # [blocks, bs]
        assert len(snapshots) < 300
    return list(streams.values()), snapshots, blocks_per_forward


def test_accept_threshold_sets_how_many_tokens_a_step_decodes(llada_checkpoint):
    nfe = {a: sum(decode(llada_checkpoint, accept_threshold=a)[1]) for a in (0.0, 0.5, 0.9)}
    assert nfe[0.0] == 4 * len(PROMPTS)  # every masked position clears 0: one forward per block
    assert nfe[0.0] < nfe[0.5] < nfe[0.9]


def test_accept_threshold_of_a_request_overrides_the_config(llada_checkpoint):
    low = SamplingParams(max_tokens=16, ignore_eos=True, accept_threshold=0.0)
    mixed = [low, PARAMS, low, PARAMS]
    tokens, nfe = decode(llada_checkpoint, params=mixed, accept_threshold=0.9)
    want_low, nfe_low = decode(llada_checkpoint, accept_threshold=0.0)
    want_high, nfe_high = decode(llada_checkpoint, accept_threshold=0.9)
    assert tokens == [want_low[0], want_high[1], want_low[2], want_high[3]]
    assert nfe == [nfe_low[0], nfe_high[1], nfe_low[2], nfe_high[3]]


# Three blocks in flight that all accept from the start, so later blocks hold decoded tokens that remasking can
# take back.
PARALLEL_BLOCKS = dict(buffer_size=3, add_block_threshold=0.0, semi_complete_threshold=0.0, accept_threshold=0.7)


def remasked_positions(snapshots):
    """(step, request, block) of every decoded token that the next step turned back into a mask."""
    found = []
    for step, (before, after) in enumerate(zip(snapshots, snapshots[1:])):
        for r, (b, a) in enumerate(zip(before, after)):
            for k in torch.nonzero(((b != MASK_ID) & (a == MASK_ID)).any(dim=1)).flatten().tolist():
                found.append((step, r, k))
    return found


def test_remask_threshold_returns_unsure_tokens_of_later_blocks_to_mask(llada_checkpoint):
    kept, kept_snapshots, _ = trace(llada_checkpoint, remask_threshold=0.0, **PARALLEL_BLOCKS)
    remasking, remask_snapshots, _ = trace(llada_checkpoint, remask_threshold=0.3, **PARALLEL_BLOCKS)
    assert remasked_positions(kept_snapshots) == []
    remasked = remasked_positions(remask_snapshots)
    assert remasked
    # Never in the first block in flight, which is what guarantees progress: before the step, some earlier
    # block of the request still had a mask.
    for step, r, k in remasked:
        assert bool((remask_snapshots[step][r][:k] == MASK_ID).any())
    assert sum(s.nfe for s in remasking) > sum(s.nfe for s in kept)
    assert all(len(s.token_ids) == 16 for s in remasking)


def test_remask_threshold_of_a_request_overrides_the_config(llada_checkpoint):
    remask = SamplingParams(max_tokens=16, ignore_eos=True, remask_threshold=0.3)
    tokens, nfe = decode(llada_checkpoint, params=[remask, PARAMS, remask, PARAMS], **PARALLEL_BLOCKS)
    want_on, nfe_on = decode(llada_checkpoint, remask_threshold=0.3, **PARALLEL_BLOCKS)
    want_off, nfe_off = decode(llada_checkpoint, remask_threshold=0.0, **PARALLEL_BLOCKS)
    assert tokens == [want_on[0], want_off[1], want_on[2], want_off[3]]
    assert nfe == [nfe_on[0], nfe_off[1], nfe_on[2], nfe_off[3]]
    assert nfe_on != nfe_off


def test_add_block_threshold_sets_when_the_next_block_joins(llada_checkpoint):
    config = dict(buffer_size=3, accept_threshold=0.7)
    _, _, eager = trace(llada_checkpoint, add_block_threshold=0.0, **config)
    _, _, strict = trace(llada_checkpoint, add_block_threshold=1.0, **config)
    assert max(eager) == 3  # a block joins as soon as there is room
    assert max(strict) == 1  # the last block must be full first, and a full first block commits


def predecessor_full_whenever_decoding(snapshots) -> bool:
    """Whether every block that holds a decoded token follows a fully decoded block."""
    for blocks in (b for snapshot in snapshots for b in snapshot):
        started = (blocks != MASK_ID).any(dim=1)
        full = (blocks != MASK_ID).all(dim=1)
        if bool((started[1:] & ~full[:-1]).any()):
            return False
    return True


def test_semi_complete_threshold_holds_later_blocks_until_their_predecessor_fills(llada_checkpoint):
    config = dict(buffer_size=3, add_block_threshold=0.0, accept_threshold=0.7)
    _, waiting, _ = trace(llada_checkpoint, semi_complete_threshold=1.0, **config)
    _, eager, _ = trace(llada_checkpoint, semi_complete_threshold=0.0, **config)
    assert predecessor_full_whenever_decoding(waiting)
    assert not predecessor_full_whenever_decoding(eager)
