"""kv_cache_dtype "fp8" on the GPU: the engine's CUDA graphs over FP8 rows (the Triton attention's FP8 loads, the
store's scales) give the tokens of its eager steps."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from kernel_cases import graph_and_eager_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton attention needs a CUDA device")

SHAPE = dict(hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=1024)  # head_dim 128
# float32: a graph's padded rows and an eager step's rows take the same kernels, so the two decode the same tokens
# (in bf16 they pick other GEMM kernels, and a random model's near-ties part them over a float cache as well).
SETTINGS = dict(block_size=8, page_size=16, max_model_len=256, max_num_reqs=4, device="cuda", dtype="float32",
                attention_backend="triton")


def test_graphs_over_fp8_rows_give_the_tokens_of_eager_steps(tmp_path):
    path = str(write_random_checkpoint(tmp_path / "dream", "dream", seed=5, **SHAPE))
    prompts = ["fp8 rows on the GPU", "a second prompt, longer than the first one, so that it spans pages"]
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def check(llm):
        assert llm.runner.kv_cache.dtype == torch.uint8 and llm.model.fused_kernels

    graphs, eager = graph_and_eager_tokens(path, prompts, params, check, **SETTINGS, num_kv_pages=64,
                                           kv_cache_dtype="fp8")
    assert graphs == eager
