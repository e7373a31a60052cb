"""Greedy rows sampled from each tensor-parallel rank's share of the logits give what sampling the whole rows gives:
the token (the lower id on a tie, across ranks too), every confidence kind, the logsumexp, and the current token's
logit (-inf for the mask token). The ranks are threads with real gloo groups; both paths run: the tensor ops, and
on CUDA's side the two kernels around the all-gather (here under Triton's interpreter)."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from diffulex_backend.sampling import Confidence, greedy_over_shards, sample_reference
from diffulex_backend.tensor_parallel import TensorParallel


@pytest.fixture(scope="module")
def groups():
    """TensorParallel objects of 1 to 3 ranks each, over gloo groups in this process."""
    made = {}
    for size in (1, 2, 3):
        if size == 1:
            made[size] = [TensorParallel()]
            continue
        store = dist.HashStore()
        ranks = [None] * size

        def join(rank, store=store, ranks=ranks, size=size):
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timedelta(seconds=60)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            ranks[rank] = TensorParallel(rank, size, group=dist.ProcessGroupGloo(store, rank, size, options))

        threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        made[size] = ranks
    return made


class OneKernelAtATime:
    """A rank's TensorParallel whose thread holds `lock` except inside the all-gather: Triton's interpreter runs one
    kernel at a time in a process, and the ranks here are threads of one."""

    def __init__(self, tp: TensorParallel, lock: threading.Lock):
        self.tp, self.lock, self.size = tp, lock, tp.size

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.lock.release()
        try:
            return self.tp.gather(tensor)
        finally:
            self.lock.acquire()


def over_ranks(tps: list[TensorParallel], logits: torch.Tensor, mask: int, current, kinds, use_kernel: bool):
    """Rank 0's answer, each rank calling greedy_over_shards on its share at once."""
    vocab = logits.shape[1]
    columns = -(-vocab // len(tps))
    padded = torch.cat([logits, torch.full((logits.shape[0], columns * len(tps) - vocab), 9.0, dtype=logits.dtype)],
                       dim=1)  # the head's padding rows: above every logit, and never counted
    answers = [None] * len(tps)
    lock = threading.Lock()

    def rank_step(tp):
        start = tp.rank * columns
        with lock:
            answers[tp.rank] = greedy_over_shards(padded[:, start:start + columns].contiguous(), start, vocab, mask,
                                                  current, kinds, OneKernelAtATime(tp, lock), use_kernel=use_kernel)

    threads = [threading.Thread(target=rank_step, args=(tp,)) for tp in tps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result, current_logit in answers[1:]:  # every rank ends with the same answer
        assert torch.equal(result.tokens, answers[0][0].tokens) and torch.equal(current_logit, answers[0][1])
    return answers[0]


@settings(max_examples=40, deadline=None)
@given(size=st.sampled_from([1, 2, 3]), rows=st.integers(1, 5), vocab=st.integers(6, 300),
       use_kernel=st.booleans(), data=st.data())
def test_greedy_rows_over_shares_give_the_whole_rows_answer(groups, size, rows, vocab, use_kernel, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values, so that ties (within a rank and across ranks) are common.
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).to(torch.float64) * 0.5
    mask = data.draw(st.integers(0, vocab - 1))
    current = torch.randint(0, vocab, (rows,), generator=gen)
    current[0] = mask
    kinds = torch.randint(0, len(Confidence), (rows,), generator=gen)
    dtype = torch.float32 if use_kernel else torch.float64
    result, current_logit = over_ranks(groups[size], logits.to(dtype), mask, current, kinds, use_kernel)

    whole = logits.clone()
    whole[:, mask] = float("-inf")
    zeros = torch.zeros(rows, dtype=torch.float64)
    ref = sample_reference(whole, zeros, zeros.long(), kinds)
    assert torch.equal(result.tokens, ref.tokens)
    tolerance = dict(rtol=1e-5, atol=1e-6) if use_kernel else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.confidence.double(), ref.confidence, **tolerance)
    torch.testing.assert_close(result.logsumexp.double(), ref.logsumexp, **tolerance)
    assert torch.equal(current_logit.double(), whole.gather(1, current[:, None]).squeeze(1))


@pytest.mark.parametrize("use_kernel", [False, True], ids=["tensor ops", "kernels"])
def test_a_rank_whose_whole_share_is_the_mask_token_adds_nothing(groups, use_kernel):
    """Seven ids over three ranks leave the last rank one column, the mask token's: its share is all -inf, holds
    no mass, and every confidence kind comes out as the whole row's (no NaN)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=gen)
    kinds = torch.tensor([int(k) for k in Confidence])
    current = torch.tensor([0, 6, 3])
    dtype = torch.float32 if use_kernel else torch.float64
    result, current_logit = over_ranks(groups[3], logits.to(dtype), 6, current, kinds, use_kernel)
    whole = logits.double().clone()
    whole[:, 6] = float("-inf")
    ref = sample_reference(whole, torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long), kinds)
    assert torch.equal(result.tokens, ref.tokens)
    torch.testing.assert_close(result.confidence.double(), ref.confidence, rtol=1e-5, atol=1e-6)
    assert torch.equal(current_logit.double(), whole.gather(1, current[:, None]).squeeze(1))
