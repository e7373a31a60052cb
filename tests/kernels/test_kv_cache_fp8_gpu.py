"""kv_cache_dtype "fp8" on the GPU: the engine's CUDA graphs over FP8 rows (the Triton attention's FP8 loads, the
store's scales) give the forward of their steps (kernel_cases.replay_against_eager)."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from kernel_cases import FP8_REPLAY_BOUND, replay_against_eager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton attention needs a CUDA device")

SHAPE = dict(hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=1024)  # head_dim 128
SETTINGS = dict(block_size=8, page_size=16, max_model_len=256, max_num_reqs=4, device="cuda", dtype="float32",
                attention_backend="triton")


def test_graph_replays_over_fp8_rows_give_the_forward_of_their_steps(tmp_path):
    path = str(write_random_checkpoint(tmp_path / "dream", "dream", seed=5, **SHAPE))
    llm = Diffulex(path, **SETTINGS, num_kv_pages=64, kv_cache_dtype="fp8")
    try:
        assert llm.runner.kv_cache.dtype == torch.uint8 and llm.model.fused_kernels
        seen = replay_against_eager(llm, ["fp8 rows on the GPU",
                                          "a second prompt, longer than the first one, so that it spans pages"],
                                    SamplingParams(max_tokens=48, ignore_eos=True))
    finally:
        llm.close()
    assert max(seen.padded) == 0
    assert max(seen.eager) < FP8_REPLAY_BOUND, seen.eager
