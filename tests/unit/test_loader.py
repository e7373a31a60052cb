"""Loading checkpoint directories: sharded or not, in a dtype, and every way a checkpoint can be broken."""
import logging
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex_backend.testing.checkpoint import write_random_checkpoint
from diffulex_backend.loader import CheckpointError, CorruptWeight, detect_model_name, load_model
from diffulex_backend.registry import AutoModelForDiffusionLM


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("llada"), "llada", num_layers=1, seed=7)


@pytest.fixture
def broken(tmp_path, llada_dir):
    """A fresh copy of a good checkpoint to break."""
    return shutil.copytree(llada_dir, tmp_path / "ckpt")


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def raises(message):
    return pytest.raises(CheckpointError, match=re.escape(message))


def test_sharded_checkpoint_loads_the_same_weights_as_unsharded(tmp_path):
    single = load_model(write_random_checkpoint(tmp_path / "one", "dream", seed=11))
    sharded_dir = write_random_checkpoint(tmp_path / "three", "dream", seed=11, num_shards=3)
    assert not (sharded_dir / "model.safetensors").exists()
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sharded = load_model(sharded_dir)
    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_loading_logs_each_weights_file_it_reads(tmp_path, caplog):
    directory = write_random_checkpoint(tmp_path / "three", "dream", seed=11, num_shards=3)
    with caplog.at_level(logging.INFO, logger="diffulex_backend.loader"):
        load_model(directory)
    read = [record.getMessage() for record in caplog.records if record.getMessage().startswith("read weights")]
    assert [line.split(",")[0] for line in read] == [f"read weights file {i} of 3" for i in (1, 2, 3)]
    assert [line.split(", ")[1].split(" ")[0] for line in read] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_loads_in_the_requested_dtype(llada_dir):
    fp32, bf16 = load_model(llada_dir), load_model(llada_dir, dtype=torch.bfloat16)
    for (name, a), b in zip(fp32.state_dict().items(), bf16.state_dict().values()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def test_model_name_is_detected_from_model_type_then_architectures():
    assert detect_model_name({"model_type": "Dream"}, "config.json") == "dream"
    assert detect_model_name({"model_type": "sdar"}, "config.json") == "sdar"
    assert detect_model_name({"architectures": ["LLaDAModelLM"]}, "config.json") == "llada"
    with raises("config.json: config key 'model_type' is 'gpt2' (architectures ['GPT2LMHeadModel']), which names"
                " no registered model; registered: ['diffucoder', 'diffusion_gemma', 'dream', 'dream_reasoner', 'fast_dllm_v2', 'llada', 'llada2', 'sdar', 'sdar_moe', 'stable_diffcoder']"):
        detect_model_name({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "config.json")


def test_explicit_model_name_is_used_over_detection(broken):
    edit_config(broken, model_type="something-else", architectures=["Unknown"])
    assert load_model(broken, model_name="llada").arch.model_name == "llada"


def test_an_unknown_model_name_is_refused_by_name_before_the_checkpoint_is_read(tmp_path):
    with pytest.raises(ValueError, match=re.escape("config field 'model_name' must be one of ['diffucoder', ") +
                       ".*" + re.escape(" or null, got 'gpt2'")):
        load_model(tmp_path / "nope", model_name="gpt2")


def test_a_checkpoint_that_does_not_fit_the_family_the_settings_name_says_they_named_it(llada_dir):
    with raises(f"{llada_dir / 'config.json'}: missing required config key 'hidden_size' (read as model_name "
                "'dream', the settings' model_name; set model_name to load the checkpoint as another family: ["):
        load_model(llada_dir, model_name="dream")


def test_a_model_name_may_be_an_alias(tmp_path):
    assert "llada2_mini" in AutoModelForDiffusionLM and "llada2_mini" not in AutoModelForDiffusionLM.keys()
    with raises(f"{tmp_path / 'nope'}: checkpoint directory not found"):  # past the name, to the checkpoint
        load_model(tmp_path / "nope", model_name="llada2_mini")


def test_missing_directory(tmp_path):
    with raises(f"{tmp_path / 'nope'}: checkpoint directory not found"):
        load_model(tmp_path / "nope")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with raises(f"{broken / 'config.json'}: file not found"):
        load_model(broken)


def test_corrupt_config_json(broken):
    (broken / "config.json").write_text('{"d_model": 64,')
    with raises(f"{broken / 'config.json'}: not valid JSON"):
        load_model(broken)


def test_unknown_config_key_loads_with_a_warning_that_names_it(broken, caplog):
    edit_config(broken, use_flux_capacitor=True)
    with caplog.at_level("WARNING", logger="diffulex_backend.loader"):
        model = load_model(broken)
    assert model.arch.unrecognized_config_keys == ("use_flux_capacitor",)
    assert f"{broken / 'config.json'}: config keys ['use_flux_capacitor'] are unknown to model 'llada'" in caplog.text


def test_released_keys_load_quietly(llada_dir, caplog):
    with caplog.at_level("WARNING", logger="diffulex_backend.loader"):
        model = load_model(llada_dir)
    assert model.arch.unrecognized_config_keys == () and caplog.text == ""


def test_missing_config_key(broken):
    edit_config(broken, n_layers=None)
    with raises(f"{broken / 'config.json'}: missing required config key 'n_layers'"):
        load_model(broken)


def test_config_value_this_engine_does_not_implement(broken):
    edit_config(broken, block_type="sequential")
    with raises(f"{broken / 'config.json'}: config key 'block_type' is 'sequential'; only 'llama' is supported"):
        load_model(broken)


def test_bad_config_value_type(broken):
    edit_config(broken, n_heads="4")
    with raises(f"{broken / 'config.json'}: config key 'n_heads' must be a positive integer, got '4'"):
        load_model(broken)


def test_missing_weights_file(broken):
    (broken / "model.safetensors").unlink()
    with raises(f"{broken}: no weights: neither model.safetensors nor model.safetensors.index.json exists"):
        load_model(broken)


def test_missing_weight(broken):
    edit_weights(broken, lambda t: t.pop("model.transformer.blocks.0.up_proj.weight"))
    with raises(f"{broken / 'model.safetensors'}: missing weight 'model.transformer.blocks.0.up_proj.weight'"):
        load_model(broken)


def test_unexpected_weight(broken):
    edit_weights(broken, lambda t: t.update({"model.transformer.blocks.0.q_proj.bias": torch.zeros(64)}))
    with raises(f"{broken / 'model.safetensors'}: unexpected weight 'model.transformer.blocks.0.q_proj.bias'"
                " for model 'llada'"):
        load_model(broken)


def test_weight_shape_mismatch(broken):
    edit_weights(broken, lambda t: t.update({"model.transformer.blocks.0.k_proj.weight": torch.zeros(64, 64)}))
    with raises(f"{broken / 'model.safetensors'}: weight 'model.transformer.blocks.0.k_proj.weight' has shape"
                " (64, 64), expected (32, 64)"):
        load_model(broken)


def test_truncated_safetensors(broken):
    path = broken / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with raises(f"{path}: not a readable safetensors file"):
        load_model(broken)


def test_safetensors_with_a_garbage_header(broken):
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with raises(f"{broken / 'model.safetensors'}: not a readable safetensors file"):
        load_model(broken)


def test_index_that_points_at_a_missing_shard(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", "sdar", num_layers=1, num_shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first_missing = next(n for n, f in index["weight_map"].items() if f == "model-00002-of-00002.safetensors")
    with raises(f"{directory / 'model.safetensors.index.json'}: weight {first_missing!r} points at shard"
                " 'model-00002-of-00002.safetensors', which does not exist"):
        load_model(directory)


def test_index_that_lists_a_weight_its_shard_lacks(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", "sdar", num_layers=1, num_shards=2)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = next(n for n, f in index["weight_map"].items() if f == "model-00002-of-00002.safetensors")
    index["weight_map"][moved] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with raises(f"{directory / 'model-00001-of-00002.safetensors'}: missing weight {moved!r}"
                " that model.safetensors.index.json lists in it"):
        load_model(directory)


# ---- weights whose values no family can load ----------------------------------------------------------------------
def poison(name, *cells):
    """An edit that writes each (row, column, value) into weight `name`."""
    def edit(tensors):
        for row, column, value in cells:
            tensors[name][row, column] = value
    return edit


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_that_is_not_finite_is_refused_naming_it_with_no_guess_at_another_family(broken, value):
    name = "model.transformer.blocks.0.ff_out.weight"
    edit_weights(broken, poison(name, (3, 5, value)))
    message = (f"{broken / 'model.safetensors'}: weight {name!r} holds NaN or infinite values: 1 of the 8192 values "
               "read")
    # Detected or named, the family is not the fault: the message ends without the hint at another family.
    for model_name in (None, "llada"):
        with pytest.raises(CorruptWeight, match=re.escape(message) + "$"):
            load_model(broken, model_name=model_name)


def test_every_value_that_is_not_finite_is_counted(broken):
    name = "model.transformer.wte.weight"
    edit_weights(broken, poison(name, (0, 0, float("nan")), (7, 1, float("nan")), (9, 2, float("inf")),
                                (9, 3, float("-inf")), (128, 63, float("nan"))))
    with raises(f"weight {name!r} holds NaN or infinite values: 5 of the"):
        load_model(broken)


def test_a_bfloat16_checkpoint_that_is_not_finite_is_refused(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", "llada", num_layers=1, dtype=torch.bfloat16)
    name = "model.transformer.blocks.0.up_proj.weight"
    edit_weights(directory, poison(name, (0, 0, float("inf"))))
    for dtype in (torch.bfloat16, torch.float32):
        with raises(f"weight {name!r} holds NaN or infinite values: 1 of the 8192 values read"):
            load_model(directory, dtype=dtype)


def test_a_finite_value_past_the_dtype_s_range_is_refused_in_that_dtype_only(broken):
    name = "model.transformer.blocks.0.q_proj.weight"
    edit_weights(broken, poison(name, (1, 1, 1e5)))  # finite in float32 and bfloat16, infinite in float16
    with raises(f"weight {name!r} is finite in the file but past the range of float16 (largest 65504), the dtype "
                "the model loads in, at 1 of the 4096 values read; load it in a wider one"):
        load_model(broken, dtype=torch.float16)
    assert load_model(broken, dtype=torch.bfloat16).layers[0].attn.qkv_proj.weight[1, 1] == 1e5 - 1e5 % 512


def test_a_float64_value_past_float32_is_refused_with_no_wider_dtype_to_offer(broken):
    name = "model.transformer.blocks.0.q_proj.weight"
    edit_weights(broken, lambda tensors: tensors.__setitem__(name, tensors[name].double()))
    edit_weights(broken, poison(name, (1, 1, 1e300)))
    with raises(f"weight {name!r} is finite in the file but past the range of float32 (largest 3.40282e+38), the "
                "dtype the model loads in, at 1 of the 4096 values read; no dtype the model serves in but float64 "
                "holds them"):
        load_model(broken, dtype=torch.float32)


def test_a_shard_that_is_not_finite_is_named(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", "sdar", num_layers=1, num_shards=2)
    shard = directory / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    name = sorted(n for n, t in tensors.items() if t.dim() == 2)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard)
    with raises(f"{shard}: weight {name!r} holds NaN or infinite values"):
        load_model(directory)


@pytest.mark.parametrize("dtype,stored", [(torch.int8, "I8"), (torch.uint8, "U8"), (torch.int32, "I32"),
                                          (torch.int64, "I64"), (torch.bool, "BOOL"), (torch.float8_e5m2, "F8_E5M2")])
def test_a_weight_stored_as_anything_but_a_float_is_refused_naming_its_dtype(broken, dtype, stored):
    """Integers would load as numbers, and e5m2 bytes without a scale as coarse values: no error, then noise."""
    name = "model.transformer.blocks.0.ff_out.weight"
    edit_weights(broken, lambda tensors: tensors.__setitem__(name, (tensors[name] * 10).to(dtype)))
    message = (f"{broken / 'model.safetensors'}: weight {name!r} is stored as {stored}; a weight loads from F16, BF16, "
               "F32, F64, or from F8_E4M3 (float8_e4m3fn) with a 'quantization_config'")
    with pytest.raises(CorruptWeight, match=re.escape(message) + "$"):
        load_model(broken)


def test_of_two_weights_that_are_not_finite_the_one_read_first_is_named(tmp_path):
    """Layer 2's in the first shard, layer 10's in the second: the shards are read in order, and the first named."""
    directory = write_random_checkpoint(tmp_path / "ckpt", "sdar", num_layers=11, num_shards=2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    for shard in shards:
        tensors = load_file(directory / shard)
        for name in ("model.layers.2.mlp.down_proj.weight", "model.layers.10.mlp.down_proj.weight"):
            if name in tensors:
                tensors[name][0, 0] = float("nan")
        save_file(tensors, directory / shard)
    first = sorted((shards.index(index[n]), n) for n in ("model.layers.2.mlp.down_proj.weight",
                                                          "model.layers.10.mlp.down_proj.weight"))[0][1]
    with raises(f"{directory / index[first]}: weight {first!r} holds NaN"):
        load_model(directory)


def test_under_tensor_parallelism_the_rank_whose_share_is_not_finite_refuses_it(broken):
    from diffulex_backend.tensor_parallel import TensorParallel

    name = "model.transformer.blocks.0.q_proj.weight"  # column-parallel: rank 1 holds rows 32 to 63
    edit_weights(broken, poison(name, (40, 0, float("nan"))))
    load_model(broken, tp=TensorParallel(rank=0, size=2))
    with raises(f"weight {name!r} holds NaN or infinite values: 1 of the 2048 values read"):
        load_model(broken, tp=TensorParallel(rank=1, size=2))
