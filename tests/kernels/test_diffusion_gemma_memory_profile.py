"""On a GPU, an engine sized by gpu_memory_utilization profiles DiffusionGemma's step with its own sampler (the
canvas kernels over chunks of rows), not the masked families' torch sampler over every row, and then serves a full
batch of canvases from the pages that leaves."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.runner import profile_peak_memory
from diffulex_backend.strategies.diffusion_gemma import DiffusionGemmaRunner
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint
from kernel_cases import DEVICE

CANVAS, REQUESTS, VOCAB = 8, 4, 65536  # a vocabulary wide enough that the logits outweigh the tiny forward

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="the memory profile sizes the KV pool on a GPU only")


def test_the_profile_runs_diffusion_gemma_s_sampler_and_the_pool_serves_a_full_batch(tmp_path):
    checkpoint = write_random_diffusion_gemma_checkpoint(tmp_path / "ckpt", seed=2, vocab_size=VOCAB)
    llm = Diffulex(str(checkpoint), model_name="diffusion_gemma", block_size=CANVAS, page_size=4, max_model_len=64,
                   max_num_reqs=REQUESTS, max_num_batched_tokens=64, gpu_memory_utilization=0.5, dtype="bfloat16",
                   device=str(DEVICE))
    rows = REQUESTS * CANVAS
    forward, sampler = profile_peak_memory(llm.model, llm.config, DEVICE, DiffusionGemmaRunner)
    assert forward > 0
    # Its rows' bf16 logits at least; under one float32 copy of them, which the torch sampler makes several of.
    assert rows * VOCAB * 2 <= sampler < rows * VOCAB * 4
    assert llm.kv_cache.num_pages >= REQUESTS * (64 // 4)
    outputs = llm.generate([list(range(1 + i, 20 + i)) for i in range(REQUESTS)],
                           SamplingParams(max_tokens=2 * CANVAS, seed=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [2 * CANVAS] * REQUESTS
