"""DiffuCoder (Dream's math, d2f by default), Dream-reasoner (Qwen3 attention in Dream's file, not shifted) and
Stable-DiffCoder (a Llama, its mask token from the tokenizer): the defaults each brings, its forward against
transformers' own Llama and Qwen3 code and against a float64 reference written from the formulas, token-exact
decoding against plain samplers on that reference, and tokens unchanged by batching, preemption and prefix hits.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.loader import CheckpointError, detect_model_name, load_model
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, write_random_checkpoint
from engine_driver import run_one_at_a_time, run_requests, tiny_engine
from family_reference import ReferenceModel
from test_engine_exactness import PROMPTS, reference_block_diffusion, reference_llada

FAMILIES = ["diffucoder", "dream_reasoner", "stable_diffcoder"]
SYSTEM = "a shared prefix of sixteen tokens"[:16]
BATCH_PROMPTS = [SYSTEM + " and one", "the quick brown fox", SYSTEM + " and two", "ab"]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("coder_and_reasoner")
    # Dream-reasoner with a head_dim that is not hidden_size // heads, as Qwen3 allows.
    return {name: str(write_random_checkpoint(root / name, name, seed=3, **({"head_dim": 8} if name == "dream_reasoner"
                                                                            else {})))
            for name in FAMILIES}


def engine(path, family, **settings) -> Diffulex:
    return Diffulex(path, model_name=family, **{"block_size": 8, "max_model_len": 128, "max_num_batched_tokens": 128,
                                                "dtype": "float64", "device": "cpu", **settings})


def dense_meta(n: int) -> AttentionMetadata:
    """One sequence of n tokens, all in one block: every token sees every other."""
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([0], dtype=torch.int32),
        page_tables=torch.full((1, 1), -1, dtype=torch.int32), slot_mapping=torch.full((n,), -1, dtype=torch.long),
        block_ids=torch.zeros(n, dtype=torch.int32), max_seqlen_q=n, max_context_len=0, cu_seqlens_q_host=(0, n),
        context_lens_host=(0,))


# --- what each family brings -------------------------------------------------------------------------------

def test_diffucoder_is_dream_math_with_d2f_by_default(checkpoints):
    llm = engine(checkpoints["diffucoder"], "diffucoder")
    arch = llm.model.arch
    assert (llm.config.decoding_strategy, arch.shifted, arch.qkv_bias, arch.qk_norm) == ("d2f", True, True, False)
    assert llm.config.mask_token_id == MASK_TOKEN_ID  # config.json's mask_token_id
    # The file is Dream's: without model_name it loads as Dream, with Dream's default strategy.
    assert detect_model_name(json.loads(open(f"{checkpoints['diffucoder']}/config.json").read()), "c") == "dream"
    assert engine(checkpoints["diffucoder"], "dream").config.decoding_strategy == "multi_bd"
    assert engine(checkpoints["diffucoder"], "diffucoder", decoding_strategy="multi_bd").config.decoding_strategy == \
        "multi_bd"


def test_dream_reasoner_has_per_head_qk_norm_and_is_not_shifted(checkpoints):
    llm = engine(checkpoints["dream_reasoner"], "dream_reasoner")
    arch = llm.model.arch
    assert (llm.config.decoding_strategy, arch.shifted, arch.qkv_bias, arch.qk_norm) == ("multi_bd", False, False, True)
    assert (arch.head_dim, arch.block_size) == (8, 32)
    names = load_file(f"{checkpoints['dream_reasoner']}/model.safetensors").keys()
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.q_proj.bias" not in names


def test_dream_reasoner_loaded_as_the_detected_dream_names_the_weight_and_model_name(checkpoints):
    path = checkpoints["dream_reasoner"]
    with pytest.raises(CheckpointError, match=re.escape(
            "unexpected weight 'model.layers.0.self_attn.k_norm.weight' for model 'dream' (read as model_name "
            "'dream', detected from config.json; set model_name to load the checkpoint as another family: [")):
        load_model(path)


def test_stable_diffcoder_is_detected_from_its_class_names_and_takes_the_tokenizers_mask(checkpoints):
    path = checkpoints["stable_diffcoder"]
    config = json.loads(open(f"{path}/config.json").read())
    assert config["model_type"] == "llama" and "mask_token_id" not in config
    llm = tiny_engine(path)  # no model_name
    assert (llm.config.model_name, llm.config.decoding_strategy, llm.model.arch.shifted) == \
        ("stable_diffcoder", "multi_bd", False)
    assert llm.model.arch.mask_token_id is None and llm.config.mask_token_id == MASK_TOKEN_ID  # the tokenizer's
    only_auto_map = {**config, "architectures": ["LlamaForCausalLM"]}
    assert detect_model_name(only_auto_map, "config.json") == "stable_diffcoder"
    with pytest.raises(ValueError, match="names no registered model"):
        detect_model_name({**only_auto_map, "auto_map": {}}, "config.json")  # a plain Llama is not one


# --- the forward --------------------------------------------------------------------------------------------

def transformers_logits(path: str, model_cls, config_cls, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own model, in float64, from the checkpoint's tensors, every token seeing every other.
    transformers keeps RoPE angles, RMSNorm and the softmax in float32 whatever the dtype, so it agrees with a
    float64 forward to about 1e-6 of the logits' scale."""
    config = json.loads(open(f"{path}/config.json").read())
    drop = {"architectures", "auto_map", "model_type", "torch_dtype", "transformers_version", "mask_token_id",
            "block_size"}
    model = model_cls(config_cls(**{k: v for k, v in config.items() if k not in drop}, attn_implementation="eager"))
    model.load_state_dict({k: v.to(torch.float64) for k, v in load_file(f"{path}/model.safetensors").items()})
    model = model.to(torch.float64).eval()
    n = len(ids)
    with torch.no_grad():
        return model(input_ids=ids[None], attention_mask=torch.zeros(1, 1, n, n, dtype=torch.float64),
                     position_ids=torch.arange(n)[None]).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_the_formula_reference_and_transformers(checkpoints, family):
    path, n = checkpoints[family], 20
    ids = torch.randint(0, 258, (n,), generator=torch.Generator().manual_seed(1))
    model = load_model(path, model_name=family, dtype=torch.float64)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(n), dense_meta(n), None))
    reference = ReferenceModel(path, family, MASK_TOKEN_ID).forward(ids, torch.ones(n, n, dtype=torch.bool))
    scale = reference.abs().max().item()
    assert (logits - reference).abs().max().item() <= 1e-10 * scale
    if family == "diffucoder":  # transformers has no Dream
        return
    model_cls, config_cls = {"stable_diffcoder": (LlamaForCausalLM, LlamaConfig),
                             "dream_reasoner": (Qwen3ForCausalLM, Qwen3Config)}[family]
    assert (logits - transformers_logits(path, model_cls, config_cls, ids)).abs().max().item() <= 1e-5 * scale


# --- decoding, token for token ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("steps", [8, 2])
def test_vanilla_matches_the_reference_sampler(checkpoints, family, steps):
    llm = engine(checkpoints[family], family, decoding_strategy="vanilla")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, steps=steps, ignore_eos=True))
    reference = ReferenceModel(checkpoints[family], family, llm.config.mask_token_id)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_llada(reference, llm.tokenizer.encode(prompt), 24, 8, steps,
                                                llm.config.mask_token_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_strategy_matches_the_reference_block_diffusion(checkpoints, family):
    """Each family's own default: d2f (the prompt attends both ways) for DiffuCoder, multi_bd for the others."""
    llm = engine(checkpoints[family], family, buffer_size=2, page_size=4, accept_threshold=0.05,
                 add_block_threshold=0.25, semi_complete_threshold=0.5)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    reference = ReferenceModel(checkpoints[family], family, llm.config.mask_token_id)
    causal_prompt = llm.config.decoding_strategy == "multi_bd"
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_block_diffusion(reference, llm.tokenizer.encode(prompt), 16, 8, 2, 0.05,
                                                          0.25, 0.5, causal_prompt, llm.config.mask_token_id)


# --- invariance -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_do_not_depend_on_batching_or_preemption(checkpoints, family):
    path = checkpoints[family]
    config = dict(model_name=family, buffer_size=2, accept_threshold=0.5, max_num_batched_tokens=256)
    alone = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, **config), BATCH_PROMPTS, PARAMS)]
    assert all(len(t) == 16 and MASK_TOKEN_ID not in t for t in alone)
    assert [s.token_ids for s in run_requests(tiny_engine(path, **config), BATCH_PROMPTS, PARAMS)] == alone
    small = tiny_engine(path, num_kv_pages=11, **config)  # the largest request needs 10
    assert [s.token_ids for s in run_requests(small, BATCH_PROMPTS, PARAMS)] == alone
    assert small.metrics().num_preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_leave_tokens_unchanged(checkpoints, family):
    path = checkpoints[family]
    config = dict(model_name=family, decoding_strategy="multi_bd", buffer_size=2, accept_threshold=0.5)
    # One request at a time, so that the later prompts find the earlier ones' pages in the prefix cache.
    want = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, enable_prefix_caching=False, **config),
                                                     BATCH_PROMPTS, PARAMS)]
    llm = tiny_engine(path, **config)
    assert [s.token_ids for s in run_one_at_a_time(llm, BATCH_PROMPTS, PARAMS)] == want
    assert llm.metrics().prefix_cache_hit_tokens >= 16  # the third prompt reuses the first one's prefix
    assert llm.metrics().kv_pages_used == 0
