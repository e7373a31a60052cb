"""The MoE families (LLaDA2, SDAR-MoE) through the engine, token-exact against a float64 forward written from the
formulas (moe_reference.py) and the reference samplers of test_engine_exactness.py, and unchanged by batching,
preemption and prefix reuse.

The tiny LLaDA2 checkpoint has 16 experts in 4 groups of which 2 are kept, 4 experts per token, a shared expert
and a dense first layer, stored as 3 shards with an index, one expert tensor at a time as released.
"""
from __future__ import annotations

import pytest

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, write_random_checkpoint
from engine_driver import run_one_at_a_time, run_requests, tiny_engine
from moe_reference import MoEReference
from test_engine_exactness import reference_block_diffusion, reference_llada

MOE_FAMILIES = ("llada2", "sdar_moe")
PROMPTS = ["The quick brown fox", "diffusion language models decode blocks"]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {
        "llada2": str(write_random_checkpoint(root / "llada2", "llada2", num_layers=3, num_shards=3, seed=3)),
        # A dense middle layer (mlp_only_layers) between two MoE layers.
        "sdar_moe": str(write_random_checkpoint(root / "sdar_moe", "sdar_moe", num_layers=3, dense_layers=(1,),
                                                num_shards=2, seed=3)),
    }


@pytest.mark.parametrize("steps", [8, 2])
def test_llada2_vanilla_matches_reference_llada_sampler(moe_checkpoints, steps):
    path = moe_checkpoints["llada2"]
    llm = Diffulex(path, decoding_strategy="vanilla", block_size=8, max_model_len=128, max_num_batched_tokens=128,
                   dtype="float64", device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, steps=steps, ignore_eos=True))
    reference = MoEReference(path, llm.config.mask_token_id)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_llada(reference, llm.tokenizer.encode(prompt), 16, 8, steps,
                                                llm.config.mask_token_id)
    assert len({t for out in outs for t in out.token_ids}) > 4, "a degenerate model would prove little"


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("buffer_size", [1, 3])
def test_multi_bd_matches_block_causal_full_recompute(moe_checkpoints, family, buffer_size):
    path = moe_checkpoints[family]
    block_size, max_tokens, accept = 8, 16, 0.05
    # The thresholds that join and enable blocks act with a second block in flight only, and are refused without.
    thresholds = dict(add_block_threshold=0.25, semi_complete_threshold=0.5) if buffer_size > 1 else {}
    llm = Diffulex(path, decoding_strategy="multi_bd", block_size=block_size, buffer_size=buffer_size, page_size=4,
                   max_model_len=128, max_num_batched_tokens=128, accept_threshold=accept, dtype="float64",
                   device="cpu", enable_prefix_caching=False, **thresholds)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    reference = MoEReference(path, llm.config.mask_token_id)
    for prompt, out in zip(PROMPTS, outs):
        want = reference_block_diffusion(reference, llm.tokenizer.encode(prompt), max_tokens, block_size,
                                         buffer_size, accept, 0.25, 0.5, True, llm.config.mask_token_id)
        assert out.token_ids == want
    assert llm.metrics().kv_pages_used == 0


SYSTEM = "a shared prefix of sixteen tokens"[:16]
ENGINE_PROMPTS = [SYSTEM + " and one", "the quick brown fox", SYSTEM + " and two", "ab"]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_outputs_do_not_depend_on_batching_or_preemption(moe_checkpoints, family):
    path = moe_checkpoints[family]
    config = dict(decoding_strategy="multi_bd", buffer_size=2, accept_threshold=0.5, max_num_batched_tokens=256)
    alone = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, **config), ENGINE_PROMPTS, PARAMS)]
    assert all(len(t) == 16 and MASK_TOKEN_ID not in t for t in alone)
    assert [s.token_ids for s in run_requests(tiny_engine(path, **config), ENGINE_PROMPTS, PARAMS)] == alone
    small = tiny_engine(path, num_kv_pages=11, **config)  # the largest request needs 10
    assert [s.token_ids for s in run_requests(small, ENGINE_PROMPTS, PARAMS)] == alone
    assert small.metrics().num_preemptions > 0


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_prefix_cache_hit_gives_same_tokens_as_miss(moe_checkpoints, family):
    path = moe_checkpoints[family]
    config = dict(decoding_strategy="multi_bd", buffer_size=2, accept_threshold=0.5)
    want = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, enable_prefix_caching=False, **config),
                                                     ENGINE_PROMPTS, PARAMS)]
    llm = tiny_engine(path, **config)
    assert [s.token_ids for s in run_one_at_a_time(llm, ENGINE_PROMPTS, PARAMS)] == want
    assert llm.metrics().prefix_cache_hit_tokens >= 16  # the third prompt reuses the first one's prefix
    assert llm.metrics().kv_pages_used == 0


@pytest.mark.parametrize("alias", ["llada2_moe", "llada2_mini", "llada2dot1_mini"])
def test_llada2_is_served_under_the_names_diffulex_users_pass(moe_checkpoints, alias):
    path = moe_checkpoints["llada2"]
    by_alias = tiny_engine(path, model_name=alias, decoding_strategy="multi_bd")
    detected = tiny_engine(path, decoding_strategy="multi_bd")
    assert by_alias.model.arch.model_name == detected.model.arch.model_name == "llada2"
    assert [s.token_ids for s in run_requests(by_alias, ["ab"], PARAMS)] == \
        [s.token_ids for s in run_requests(detected, ["ab"], PARAMS)]


def test_config_pbtxt_parameters_pick_llada2_by_model_name(moe_checkpoints):
    """What model.py does with config.pbtxt's `parameters`, in process: `model` relative to the model's folder and
    `model_name` the Diffulex name, so the served engine decodes like one built directly."""
    from pathlib import Path

    from diffulex_backend.serving.engine_settings import engine_settings

    path = Path(moe_checkpoints["llada2"])
    parameters = {"model": path.name, "model_name": "llada2_mini", "decoding_strategy": "multi_bd",
                  "block_size": "4", "page_size": "4", "max_model_len": "96", "dtype": "float64"}
    settings = engine_settings({k: {"string_value": v} for k, v in parameters.items()}, model_dir=path.parent)
    served = Diffulex(settings.pop("model"), device="cpu", **settings)
    assert served.model.arch.model_name == "llada2"
    direct = tiny_engine(str(path), decoding_strategy="multi_bd")
    assert [s.token_ids for s in run_requests(served, ["ab"], PARAMS)] == \
        [s.token_ids for s in run_requests(direct, ["ab"], PARAMS)]


@pytest.mark.parametrize("dual_cache", [False, True])
def test_llada2_fast_dllm_refreshed_every_step_equals_vanilla_with_threshold_acceptance(moe_checkpoints, dual_cache):
    path, limits = moe_checkpoints["llada2"], dict(block_size=8, accept_threshold=0.5)
    vanilla = run_requests(tiny_engine(path, decoding_strategy="vanilla", sampling_mode="threshold", **limits),
                           PROMPTS, PARAMS)
    fast = run_requests(tiny_engine(path, decoding_strategy="fast_dllm", cache_refresh_interval=1,
                                    dual_cache=dual_cache, **limits), PROMPTS, PARAMS)
    assert [s.token_ids for s in fast] == [s.token_ids for s in vanilla]
    assert [s.nfe for s in fast] == [s.nfe for s in vanilla]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_d2f_differs_from_multi_bd_only_through_the_prompt_attention(moe_checkpoints, family):
    path, config = moe_checkpoints[family], dict(buffer_size=2, accept_threshold=0.5)

    def tokens(strategy, prompts):
        return [s.token_ids for s in run_requests(tiny_engine(path, decoding_strategy=strategy, **config),
                                                  prompts, PARAMS)]

    one_token = ["x", "y", "z"]  # no attention inside the prompt to open up
    assert tokens("d2f", one_token) == tokens("multi_bd", one_token)
    assert tokens("d2f", ENGINE_PROMPTS) != tokens("multi_bd", ENGINE_PROMPTS)
