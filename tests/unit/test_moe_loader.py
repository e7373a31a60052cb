"""The MoE families' released layout: config.json checked key by key, sharded safetensors with an index, experts stored
one at a time and packed into the stacked parameters; every error names the file and the key. And the command
that writes such a checkpoint."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex_backend.loader import CheckpointError, load_model
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, main, write_random_checkpoint

LAYER1 = "model.layers.1.mlp."


@pytest.fixture(scope="module")
def sharded_llada2(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("moe_loader") / "llada2", "llada2", num_layers=3,
                                   num_shards=3)


@pytest.fixture
def copy(sharded_llada2, tmp_path) -> Path:
    return Path(shutil.copytree(sharded_llada2, tmp_path / "copy"))


def shard_of(directory: Path, name: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def test_per_expert_tensors_are_packed_into_the_stacked_parameters(sharded_llada2):
    assert not (sharded_llada2 / "model.safetensors").exists()
    model = load_model(sharded_llada2, dtype=torch.float64)
    mlp, inter = model.layers[1].mlp, model.arch.moe_intermediate_size
    for expert in (0, 7, 15):
        prefix = f"{LAYER1}experts.{expert}."
        gate, up, down = (load_file(shard_of(sharded_llada2, prefix + n))[prefix + n].double()
                          for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
        assert torch.equal(mlp.w_gate_up[expert, :inter], gate)
        assert torch.equal(mlp.w_gate_up[expert, inter:], up)
        assert torch.equal(mlp.w_down[expert], down)
    bias_name = LAYER1 + "gate.expert_bias"
    assert torch.equal(mlp.expert_bias, load_file(shard_of(sharded_llada2, bias_name))[bias_name].double())
    assert type(model.layers[0].mlp).__name__ == "GatedMLP"  # first_k_dense_replace 1


def _rewrite(file: Path, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_missing_expert_is_named_with_the_index_that_lacks_it(copy):
    name = f"{LAYER1}experts.3.up_proj.weight"
    _rewrite(shard_of(copy, name), lambda t: t.pop(name))
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(f"{index_path}: missing weight {name!r}")):
        load_model(copy)


def test_an_expert_the_index_lists_but_its_shard_lacks_is_named_with_the_shard(copy):
    name = f"{LAYER1}experts.5.down_proj.weight"
    shard = shard_of(copy, name)
    _rewrite(shard, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: missing weight {name!r}")):
        load_model(copy)


def test_an_expert_of_the_wrong_shape_is_named_with_its_file_and_both_shapes(copy):
    name = f"{LAYER1}experts.2.gate_proj.weight"
    shard = shard_of(copy, name)
    _rewrite(shard, lambda t: t.update({name: t[name][:16].contiguous()}))
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{shard}: weight {name!r} has shape (16, 64), expected (32, 64)")):
        load_model(copy)


def test_an_expert_that_is_not_finite_is_named_with_its_shard(copy):
    name = f"{LAYER1}experts.9.up_proj.weight"
    shard = shard_of(copy, name)
    _rewrite(shard, lambda t: t[name][4].fill_(float("nan")))
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{shard}: weight {name!r} holds NaN or infinite values: 64 of the 2048 "
                                       "values read")):
        load_model(copy)


def test_an_expert_beyond_num_experts_is_unexpected(copy):
    name = f"{LAYER1}experts.16.gate_proj.weight"
    shard = shard_of(copy, f"{LAYER1}experts.2.gate_proj.weight")
    _rewrite(shard, lambda t: t.update({name: t[f"{LAYER1}experts.2.gate_proj.weight"].clone()}))
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: unexpected weight {name!r} for model 'llada2'")):
        load_model(copy)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(use_bias=True), "config key 'use_bias' is True; only False is supported"),
    (lambda c: c.pop("use_bias"), "config key 'use_bias' is True; only False is supported"),
    (lambda c: c.update(score_function="softmax"), "config key 'score_function' is 'softmax'"),
    (lambda c: c.update(moe_shared_expert_intermediate_size=64),
     "config key 'moe_shared_expert_intermediate_size' (64) differs from moe_intermediate_size * num_shared_experts"),
    (lambda c: c.update(rotary_dim=16), "config key 'rotary_dim' (16) differs"),
    (lambda c: c.update(topk_group=5), "topk_groups (5) exceeds num_expert_groups (4)"),
])
def test_llada2_config_errors_name_the_file_and_key(copy, edit, message):
    config_path = copy / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(f"{config_path}: ") + ".*" + re.escape(message)):
        load_model(copy)


def test_sdar_moe_mlp_only_layers_keep_the_dense_mlp(tmp_path):
    path = write_random_checkpoint(tmp_path / "sdar_moe", "sdar_moe", num_layers=3, dense_layers=(1,))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "sdar_moe" and config["mlp_only_layers"] == [1]
    model = load_model(path)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MoE", "GatedMLP", "MoE"]
    assert model.layers[0].mlp.shared_experts is None and model.layers[0].mlp.expert_bias is None
    assert model.arch.num_params() == sum(p.numel() for p in model.parameters())


def test_checkpoint_command_writes_a_tiny_llada2_in_the_released_layout(tmp_path, capsys):
    out = tmp_path / "tiny"
    main(["--family", "llada2", "--shape", "llada2-tiny", "--num-layers", "3", "--num-shards", "2", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llada2_moe" and config["architectures"] == ["LLaDA2MoeModelLM"]
    assert "mask_token_id" not in config  # as released: the mask token is the tokenizer's
    assert json.loads((out / "tokenizer_config.json").read_text())["mask_token"] == "<|mdm_mask|>"
    model = load_model(out)
    assert model.arch.num_layers == 3 and model.arch.num_experts == 16
    assert model.arch.num_params() == sum(p.numel() for p in model.parameters())
    assert MASK_TOKEN_ID < model.arch.vocab_size


def test_checkpoint_command_refuses_a_shape_of_another_family(tmp_path):
    with pytest.raises(SystemExit):
        main(["--family", "llada", "--shape", "llada2-mini", str(tmp_path / "x")])


def test_a_bf16_model_keeps_the_expert_bias_in_float32(sharded_llada2):
    name = LAYER1 + "gate.expert_bias"
    stored = load_file(shard_of(sharded_llada2, name))[name]
    assert stored.dtype == torch.float32  # written as the released buffer is
    model = load_model(sharded_llada2, dtype=torch.bfloat16)
    mlp = model.layers[1].mlp
    assert mlp.w_gate_up.dtype == torch.bfloat16
    assert mlp.expert_bias.dtype == torch.float32 and torch.equal(mlp.expert_bias, stored)
