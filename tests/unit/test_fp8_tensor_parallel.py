"""FP8 under tensor parallelism on the CPU: two ranks over gloo, token for token against one rank in float64. Each
rank takes its share of a released checkpoint's fp8 weights and of their scales (block scales split along the rows
of q/k/v and gate/up, along the column blocks of o_proj and down_proj), and quantizing at load gives every rank the
scales one rank computes (a row-parallel row's maximum is taken over the ranks)."""
from __future__ import annotations

import pytest

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from fp8_checkpoints import write_fp8_pair

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
SETTINGS = dict(dtype="float64", max_num_reqs=4, max_model_len=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def generate(checkpoint, **settings) -> list[list[int]]:
    engine = Diffulex(str(checkpoint), **SETTINGS, **settings)
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    finally:
        engine.close()


@pytest.mark.parametrize("family,shape,settings", [
    ("llada", {}, {}),
    ("sdar_moe", MOE, {}),
    ("sdar_moe", MOE, {"expert_parallel": True}),
], ids=["llada", "sdar_moe", "sdar_moe-expert-parallel"])
def test_two_ranks_quantizing_at_load_give_the_tokens_of_one(tmp_path, family, shape, settings):
    checkpoint = write_random_checkpoint(tmp_path / family, family, seed=3, **shape)
    one = generate(checkpoint, quantization="fp8")
    assert one != generate(checkpoint)  # the weights the ranks agree on are the quantized ones
    assert generate(checkpoint, quantization="fp8", tensor_parallel_size=2, **settings) == one


@pytest.mark.parametrize("family,shape", [("llada", {}), ("sdar_moe", MOE)], ids=["llada", "sdar_moe"])
def test_two_ranks_share_a_block_scaled_release_as_one_rank_holds_it(tmp_path, family, shape):
    source = write_random_checkpoint(tmp_path / family, family, seed=4, **shape)
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    # Blocks of 32: a row-parallel share of 64 or 32 columns is whole column blocks.
    write_fp8_pair(source, fp8_dir, float_dir, (32, 32))
    one = generate(fp8_dir)
    assert one == generate(float_dir)
    assert generate(fp8_dir, tensor_parallel_size=2) == one
