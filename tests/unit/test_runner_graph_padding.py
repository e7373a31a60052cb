"""A forward padded into a CUDA graph bucket gives what the unpadded batch gives, on the CPU torch path.

The graphs themselves need a GPU; what they replay is `PaddedForward`, the model over static buffers padded
to a bucket (empty sequences, rows that belong to no sequence and store nothing). Here the engine runs with
that padded forward in place of its eager one, in float64, and must produce the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.cuda_graph import GraphBucket, PaddedForward, round_up_seqs, round_up_tokens
from diffulex_backend.forward_batch import ForwardBatch, flat_layout
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from diffulex_backend.testing.diffusion_gemma_checkpoint import TINY, write_random_diffusion_gemma_checkpoint

PROMPTS = ["The quick brown fox", "hi", "diffusion language models decode blocks in parallel", "abc"]


def pad_batch(batch: ForwardBatch, bucket: GraphBucket, num_page_columns: int, max_context_len: int) -> ForwardBatch:
    """The batch padded to the bucket's sizes on the host, as a replay sees it (cuda_graph.py's docstring)."""
    layout = flat_layout(bucket.num_tokens, bucket.num_seqs, num_page_columns)
    return ForwardBatch(batch.padded_flat(layout), layout, bucket.num_tokens, bucket.num_seqs, bucket.max_seqlen_q,
                        max_context_len)


class CountingPaddedForward(PaddedForward):
    """The padded forward, counting the steps that went through it."""

    runs = 0

    def run(self, bucket, batch, *changed):
        self.runs += 1
        return super().run(bucket, batch, *changed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("padding")
    return {name: str(write_random_checkpoint(root / name, name, seed=5)) for name in ("llada", "dream")}


def make_engine(path, strategy, **kwargs):
    # The thresholds that join and enable blocks act with a second block in flight only, and are refused without.
    several = kwargs.get("buffer_size", 1) > 1 and strategy in ("multi_bd", "d2f", "dmax")
    thresholds = dict(add_block_threshold=0.25, semi_complete_threshold=0.5) if several else {}
    return Diffulex(path, decoding_strategy=strategy, block_size=8, page_size=4, max_model_len=128,
                    max_num_batched_tokens=128, max_num_reqs=8, accept_threshold=0.9, dtype="float64",
                    **thresholds, **kwargs)


def generate(engine, padded: bool):
    if padded:
        runner = engine.runner
        runner.padded_forward = CountingPaddedForward(engine.model, runner.kv_cache, engine.config, engine.device)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    return [o.token_ids for o in outs], engine.runner.padded_forward


@pytest.mark.parametrize("model_name,strategy,buffer_size", [
    ("llada", "multi_bd", 1), ("llada", "d2f", 2),
    ("dream", "multi_bd", 3),  # dream is shifted: a block's first token comes from a carried hidden state
])
def test_padded_forward_gives_the_eager_tokens(checkpoints, model_name, strategy, buffer_size):
    path = checkpoints[model_name]
    eager, _ = generate(make_engine(path, strategy, buffer_size=buffer_size), padded=False)
    padded, forward = generate(make_engine(path, strategy, buffer_size=buffer_size), padded=True)
    assert padded == eager
    assert forward.runs > 5, "decode steps should have gone through the padded forward"


def test_padded_rows_leave_the_real_rows_unchanged(checkpoints):
    engine = make_engine(checkpoints["llada"], "multi_bd", buffer_size=2)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()  # the prompts' prefill; the next steps are decode steps over a cached context
    engine.step()
    plans = engine.scheduler.schedule().plans
    batch = engine.runner.build_batch(plans)
    runner = engine.runner
    padded_forward = PaddedForward(engine.model, runner.kv_cache, engine.config, engine.device)
    bucket = padded_forward.bucket_for(batch)
    assert bucket is not None
    with torch.inference_mode():
        eager = runner.forward(batch)
        padded = padded_forward.run(bucket, batch)
        wider = padded_forward.run(GraphBucket(bucket.num_tokens + 64, 8, bucket.max_seqlen_q), batch)
    assert padded.shape == eager.shape == wider.shape
    assert torch.allclose(padded, eager, rtol=1e-12, atol=1e-12)
    assert torch.allclose(wider, eager, rtol=1e-12, atol=1e-12)


def test_pad_batch_adds_empty_sequences_and_rows_that_store_nothing(checkpoints):
    engine = make_engine(checkpoints["llada"], "multi_bd")
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    batch = engine.runner.build_batch(engine.scheduler.schedule().plans)
    bucket = GraphBucket(num_tokens=round_up_tokens(batch.num_tokens) + 32, num_seqs=4, max_seqlen_q=128)
    padded = pad_batch(batch, bucket, num_page_columns=32, max_context_len=128)
    n, b = batch.num_tokens, batch.num_seqs
    assert padded.input_ids.shape == padded.slot_mapping.shape == padded.block_ids.shape == (bucket.num_tokens,)
    assert torch.equal(padded.input_ids[:n], batch.input_ids)
    assert torch.equal(padded.slot_mapping[:n], batch.slot_mapping)
    assert (padded.slot_mapping[n:] == -1).all()
    assert padded.cu_seqlens_q.tolist() == batch.cu_seqlens_q.tolist() + [n]
    assert padded.context_lens.tolist() == batch.context_lens.tolist() + [0]
    assert padded.page_tables.shape == (4, 32)
    assert torch.equal(padded.page_tables[:b, : batch.page_tables.shape[1]], batch.page_tables)
    assert (padded.page_tables[b:] == -1).all() and (padded.page_tables[:, batch.page_tables.shape[1]:] == -1).all()
    assert (padded.max_seqlen_q, padded.max_context_len) == (128, 128)


def test_buckets_pad_little_and_nest():
    for n in range(1, 5000):
        padded = round_up_tokens(n)
        assert padded >= n and round_up_tokens(padded) == padded
        assert padded - n < 32 or padded - n <= n / 16
    assert [round_up_seqs(n) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]


def test_prefill_and_oversized_batches_fit_no_bucket(checkpoints):
    engine = make_engine(checkpoints["llada"], "multi_bd")
    engine.add_request(list(range(1, 90)), SamplingParams(max_tokens=8, ignore_eos=True))
    batch = engine.runner.build_batch(engine.scheduler.schedule().plans)
    forward = PaddedForward(engine.model, engine.runner.kv_cache, engine.config, engine.device)
    assert batch.max_seqlen_q == 97 > forward.max_seqlen_q
    assert forward.bucket_for(batch) is None


def test_diffusion_gemma_s_padded_forward_gives_the_eager_tokens(tmp_path):
    """DiffusionGemma's forward takes two inputs per row beside the ids (whether a row is a canvas row, and its
    self-conditioning embedding) and its runner writes each canvas's random start tokens over the batch's ids: the
    padded forward carries all three, and padding rows (no canvas, zero embeddings) change no real row."""
    path = str(write_random_diffusion_gemma_checkpoint(tmp_path / "gemma", seed=5))
    canvas = TINY["canvas_length"]
    settings = dict(model_name="diffusion_gemma", block_size=canvas, page_size=4, max_model_len=128,
                    max_num_batched_tokens=64, dtype="float64", device="cpu")
    params = [SamplingParams(max_tokens=2 * canvas, seed=7 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = [o.token_ids for o in Diffulex(path, **settings).generate(PROMPTS, params)]
    engine = Diffulex(path, **settings)
    runner = engine.runner
    runner.padded_forward = forward = CountingPaddedForward(engine.model, runner.kv_cache, engine.config,
                                                            engine.device)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == eager
    assert forward.runs > 5, "canvas steps should have gone through the padded forward"
