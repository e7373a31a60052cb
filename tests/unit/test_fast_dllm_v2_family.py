"""The fast_dllm_v2 model family: Fast_dLLM_v2_7B's config.json keys, its Qwen2 weight names, its mask token,
and the random-checkpoint writer's tiny shape."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from diffulex_backend.loader import detect_model_name
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, main as write_checkpoint_cli, write_random_checkpoint
from released_configs import FAST_DLLM_V2_7B

# Efficient-Large-Model/Fast_dLLM_v2_7B: Qwen2.5-7B-Instruct's config plus bd_size, layer_types and auto_map.
RELEASED_CONFIG = FAST_DLLM_V2_7B

FAMILY = AutoModelForDiffusionLM.get("fast_dllm_v2")


def test_released_config_parses_to_a_shifted_qwen2_with_its_training_block_size():
    arch = FAMILY.parse_config(RELEASED_CONFIG, "config.json")
    expected = dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                    intermediate_size=18944, vocab_size=152064, eos_token_ids=(151645,), rope_theta=1e6,
                    max_position_embeddings=32768, shifted=True, block_size=32, qkv_bias=True, qk_norm=False,
                    tie_word_embeddings=False)
    assert {key: getattr(arch, key) for key in expected} == expected


def test_mask_token_is_the_released_tokenizers_when_config_names_none():
    assert FAMILY.parse_config(RELEASED_CONFIG, "config.json").mask_token_id == 151665
    assert FAMILY.parse_config({**RELEASED_CONFIG, "mask_token_id": 7}, "config.json").mask_token_id == 7


def test_family_is_detected_from_model_type_and_from_architectures():
    assert detect_model_name(RELEASED_CONFIG, "config.json") == "fast_dllm_v2"
    assert detect_model_name({"architectures": ["Fast_dLLM_QwenForCausalLM"]}, "config.json") == "fast_dllm_v2"


@pytest.mark.parametrize("edit,message", [
    (dict(bd_size=0), "'bd_size' must be a positive integer"),
    (dict(layer_types=["sliding_attention"] * 28), "'layer_types' must list 'full_attention'"),
    (dict(use_sliding_window=True), "'use_sliding_window' is True"),
])
def test_config_errors_name_the_key(edit, message):
    with pytest.raises(ValueError, match=message):
        FAMILY.parse_config({**RELEASED_CONFIG, **edit}, "config.json")


def test_a_key_fast_dllm_v2_does_not_read_is_kept_for_the_warning():
    arch = FAMILY.parse_config({**RELEASED_CONFIG, "block_size": 32}, "config.json")
    assert (arch.block_size, arch.unrecognized_config_keys) == (32, ("block_size",))  # bd_size, not block_size


def test_missing_bd_size_is_an_error():
    config = {k: v for k, v in RELEASED_CONFIG.items() if k != "bd_size"}
    with pytest.raises(ValueError, match="missing required config key 'bd_size'"):
        FAMILY.parse_config(config, "config.json")


def test_written_checkpoint_has_the_released_keys_and_qwen2_weight_names(tmp_path):
    path = write_random_checkpoint(tmp_path / "m", "fast_dllm_v2")
    config = json.loads((path / "config.json").read_text())
    assert set(config) == set(RELEASED_CONFIG)
    assert detect_model_name(config, path) == "fast_dllm_v2"
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.bias",
            "model.layers.1.mlp.gate_proj.weight"} <= names
    assert not any("norm" in n and "self_attn" in n for n in names)  # no q/k norm: Qwen2, not Qwen3
    arch = FAMILY.parse_config(config, path)
    assert arch.mask_token_id is None  # the tiny tokenizer names it: the engine resolves it from there


def test_cli_writes_the_tiny_shape(tmp_path, capsys):
    write_checkpoint_cli([str(tmp_path / "tiny"), "--shape", "fast_dllm_v2-tiny", "--set", "bd_size=8"])
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert (config["model_type"], config["bd_size"]) == ("Fast_dLLM_Qwen", 8)
    from diffulex_backend import Diffulex

    llm = Diffulex(str(tmp_path / "tiny"), block_size=8, device="cpu", max_model_len=64, max_num_batched_tokens=64)
    assert (llm.config.model_name, llm.config.mask_token_id) == ("fast_dllm_v2", MASK_TOKEN_ID)
