"""dmax on CUDA: the soft-input mixture is computed inside the captured decode graphs, from their static buffers."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

PROMPTS = ["The quick brown fox", "hi", "diffusion language models decode blocks in parallel", "0123456789"]
PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # head_dim 64: the Triton attention, so the fused forward and the graphs.
    return str(write_random_checkpoint(tmp_path_factory.mktemp("dmax_graph"), "llada", seed=7, hidden_size=256,
                                       num_heads=4, num_kv_heads=4, num_layers=2, intermediate_size=512))


def generate(path, **settings):
    llm = Diffulex(path, block_size=8, page_size=16, max_model_len=128, max_num_reqs=8, buffer_size=2,
                   accept_threshold=0.3, add_block_threshold=0.25, semi_complete_threshold=0.5, dtype="float32",
                   num_kv_pages=64, device="cuda", **settings)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return tokens, llm.runner.padded_forward


def test_dmax_steps_replay_graphs_with_the_mixture(checkpoint):
    tokens, graphs = generate(checkpoint, decoding_strategy="dmax", token_merge_top_k=2)
    assert graphs is not None and graphs.graphs, "no decode step replayed a graph"
    eager, _ = generate(checkpoint, decoding_strategy="dmax", token_merge_top_k=2, enforce_eager=True)
    assert tokens == eager
    hard, _ = generate(checkpoint, decoding_strategy="multi_bd")
    assert tokens != hard  # the graphs fed the soft rows


def test_without_token_merge_or_editing_graphs_decode_as_multi_bd(checkpoint):
    hard, _ = generate(checkpoint, decoding_strategy="multi_bd")
    tokens, graphs = generate(checkpoint, decoding_strategy="dmax", token_merge_weight=0.0, edit_threshold=0.0)
    assert graphs.graphs and tokens == hard
