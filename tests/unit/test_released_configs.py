"""Released config.json files load. Each served family's released key set, as published and with a tiny shape,
loads without a warning; a key on no family's list loads with a warning that names it and stays on the model's
arch; a key whose value selects math this engine does not build is refused, naming it."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from diffulex_backend.loader import CheckpointError, detect_model_name, load_model
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from released_configs import RELEASED, STABLE_DIFFCODER_8B_INSTRUCT, with_tiny_shape

RELEASES = sorted(RELEASED)
FAMILIES = sorted({family for family, _ in RELEASED})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("released_configs")
    return {family: write_random_checkpoint(root / family, family, seed=5) for family in FAMILIES}


@pytest.mark.parametrize("family, release", RELEASES)
def test_released_key_set_loads_without_a_warning(tiny, tmp_path, caplog, family, release):
    directory = shutil.copytree(tiny[family], tmp_path / release)
    tiny_config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(with_tiny_shape(RELEASED[family, release], tiny_config)))
    with caplog.at_level("WARNING", logger="diffulex_backend.loader"):
        model = load_model(directory, model_name=family)
    assert model.arch.unrecognized_config_keys == ()
    assert caplog.text == ""
    # The tiny shape, read as from the writer's file; the released RoPE base and norm epsilon come through.
    written = load_model(tiny[family], model_name=family).arch
    assert dataclasses.replace(model.arch, rope_theta=written.rope_theta, rms_norm_eps=written.rms_norm_eps) == written
    assert (model.arch.rope_theta, model.arch.rms_norm_eps) != (written.rope_theta, written.rms_norm_eps)


@pytest.mark.parametrize("family, release", RELEASES)
def test_released_file_names_its_family_or_dream(family, release):
    """DiffuCoder's and Dream-reasoner's files say model_type "Dream": model_name picks them."""
    detected = detect_model_name(RELEASED[family, release], "config.json")
    assert detected == ("dream" if family in ("diffucoder", "dream_reasoner") else family)


@pytest.mark.parametrize("family, release", RELEASES)
def test_a_key_on_no_list_is_kept_for_the_warning(family, release):
    arch = AutoModelForDiffusionLM.get(family).parse_config({**RELEASED[family, release], "newly_added_key": 1},
                                                           "config.json")
    assert arch.unrecognized_config_keys == ("newly_added_key",)


@pytest.mark.parametrize("family, release", RELEASES)
def test_keys_every_hf_config_may_carry_load_quietly(family, release):
    """An older transformers writes every PretrainedConfig attribute: output switches, labels, generate() defaults."""
    config = {**RELEASED[family, release], "output_hidden_states": False, "return_dict": True, "id2label": {"0": "A"},
              "temperature": 1.0, "top_p": 1.0, "num_beams": 1, "_name_or_path": "/models/x"}
    assert AutoModelForDiffusionLM.get(family).parse_config(config, "config.json").unrecognized_config_keys == ()


def test_new_families_parse_to_their_released_architecture():
    parse = {family: AutoModelForDiffusionLM.get(family).parse_config(RELEASED[family, release], "config.json")
             for family, release in RELEASES}
    reasoner, coder, stable = parse["dream_reasoner"], parse["diffucoder"], parse["stable_diffcoder"]
    assert (reasoner.num_layers, reasoner.num_heads, reasoner.num_kv_heads, reasoner.head_dim) == (36, 32, 8, 128)
    assert (reasoner.qk_norm, reasoner.qkv_bias, reasoner.shifted) == (True, False, False)
    assert (reasoner.block_size, reasoner.mask_token_id) == (32, 151669)
    assert (coder.shifted, coder.qkv_bias, coder.mask_token_id, coder.model_name) == (True, True, 151666, "diffucoder")
    assert (stable.vocab_size, stable.num_kv_heads, stable.head_dim, stable.rope_theta) == (155136, 8, 128, 500000.0)
    assert (stable.shifted, stable.qkv_bias, stable.qk_norm, stable.mask_token_id) == (False, False, False, None)
    assert stable.eos_token_ids == (2,)


def test_transformers_5_spelling_of_rope_and_dtype_reads_the_same():
    v4 = AutoModelForDiffusionLM.get("stable_diffcoder").parse_config(STABLE_DIFFCODER_8B_INSTRUCT, "config.json")
    v5_file = {k: v for k, v in STABLE_DIFFCODER_8B_INSTRUCT.items() if k not in ("rope_theta", "torch_dtype")}
    v5_file.update(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, dtype="bfloat16")
    assert AutoModelForDiffusionLM.get("stable_diffcoder").parse_config(v5_file, "config.json") == v4


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("family, release, edit, message", [
    ("dream", "Dream-v0-Instruct-7B", dict(rope_scaling=YARN), "config key 'rope_scaling' is"),
    ("diffucoder", "DiffuCoder-7B-Instruct", dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "config key 'rope_scaling' is"),
    ("diffucoder", "DiffuCoder-7B-Instruct", dict(hidden_act="gelu"), "config key 'hidden_act' is 'gelu'"),
    ("dream_reasoner", "DreamReasoner-8B", dict(rope_scaling=YARN), "config key 'rope_scaling' is"),
    ("dream_reasoner", "DreamReasoner-8B", dict(attention_bias=True), "config key 'attention_bias' is True"),
    ("dream_reasoner", "DreamReasoner-8B", dict(use_sliding_window=True), "config key 'use_sliding_window' is True"),
    ("stable_diffcoder", "Stable-DiffCoder-8B-Instruct",
     dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "config key 'rope_scaling' is"),
    ("stable_diffcoder", "Stable-DiffCoder-8B-Instruct",
     dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}), "config key 'rope_parameters' is"),
    ("stable_diffcoder", "Stable-DiffCoder-8B-Instruct", dict(mlp_bias=True), "config key 'mlp_bias' is True"),
    ("stable_diffcoder", "Stable-DiffCoder-8B-Instruct", dict(attention_bias=True), "config key 'attention_bias' is True"),
    ("sdar", "SDAR-4B-Chat", dict(rope_scaling=YARN), "config key 'rope_scaling' is"),
    ("sdar_moe", "SDAR-30B-A3B-Chat", dict(rope_scaling=YARN), "config key 'rope_scaling' is"),
    ("fast_dllm_v2", "Fast_dLLM_v2_7B", dict(rope_scaling=YARN), "config key 'rope_scaling' is"),
    ("llada2", "LLaDA2.1-mini", dict(rope_scaling=YARN), "config key 'rope_scaling' is"),
    ("llada", "LLaDA-1.5", dict(alibi=True), "config key 'alibi' is True"),
])
def test_a_value_that_selects_math_not_built_is_refused_by_name(tiny, tmp_path, family, release, edit, message):
    directory = shutil.copytree(tiny[family], tmp_path / release)
    config = {**with_tiny_shape(RELEASED[family, release], json.loads((directory / "config.json").read_text())), **edit}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"^{directory / 'config.json'}: {message}"):
        load_model(directory, model_name=family)


@pytest.mark.parametrize("family, release", [(f, r) for f, r in RELEASES
                                              if f in ("diffucoder", "dream_reasoner", "stable_diffcoder")])
def test_written_checkpoint_has_the_released_key_set(tiny, family, release):
    assert set(json.loads((tiny[family] / "config.json").read_text())) == set(RELEASED[family, release])
