"""FP8 weights on the CPU: `quantization: fp8` quantizes every projection and the MoE experts at load with a scale
per output channel and leaves embeddings, norms and routers alone; released FP8 checkpoints (per-channel
weight_scale, block weight_scale_inv) load and compute exactly what their dequantized weights compute; the engine
decodes with them; and every scheme or tensor it cannot load is refused by name."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex_backend import Config, SamplingParams
from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.fp8_linear import FP8, Fp8Linear, dequantize_weight
from diffulex_backend.loader import CheckpointError, CorruptWeight, load_model
from diffulex_backend.quantization import fp8_params
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, write_random_checkpoint
from engine_driver import run_requests, tiny_engine
from fp8_checkpoints import write_fp8_pair

# Relative rounding of float8_e4m3fn's 3 mantissa bits to nearest (half a unit in the last place), and the absolute
# half-step of its subnormals, 2^-9 / 2, in units of the scale.
E4M3_HALF_ULP = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10
MOE = dict(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {"llada": write_random_checkpoint(root / "llada", "llada", seed=5),
            "dream": write_random_checkpoint(root / "dream", "dream", seed=7),
            "sdar_moe": write_random_checkpoint(root / "sdar_moe", "sdar_moe", seed=6, **MOE)}


def prefill(model, tokens: int = 9) -> torch.Tensor:
    """The logits of one causal prefill of `tokens` tokens that stores its K/V in a fresh paged cache."""
    arch = model.arch
    cache = torch.zeros(2, arch.num_layers, 4, 4, arch.num_kv_heads, arch.head_dim, dtype=model.norm.weight.dtype)
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype)  # noqa: E731
    meta = AttentionMetadata(
        cu_seqlens_q=as_tensor([0, tokens], torch.int32), context_lens=as_tensor([0], torch.int32),
        page_tables=as_tensor([[0, 1, 2, 3]], torch.int32), slot_mapping=torch.arange(tokens),
        block_ids=torch.arange(tokens, dtype=torch.int32), max_seqlen_q=tokens, max_context_len=0,
        cu_seqlens_q_host=(0, tokens), context_lens_host=(0,))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(tokens), meta, cache))


def projection_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters()
            if n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "w_gate_up",
                           "w_down"))}


@pytest.mark.parametrize("family", ["llada", "dream", "sdar_moe"])
def test_quantize_at_load_gives_per_channel_scales_within_fp8_rounding(checkpoints, family):
    plain = load_model(checkpoints[family])
    fp8 = load_model(checkpoints[family], quantization="fp8")
    params = dict(fp8.named_parameters())
    quantized = projection_params(plain)
    assert quantized and all(params[n].dtype == FP8 for n in quantized)
    for name, weight in quantized.items():
        q, scale = params[name], params[name + "_scale"]
        assert scale.shape == (*weight.shape[:-1], 1) and scale.dtype == torch.float32
        # Each row's largest magnitude lands on the top of e4m3's range.
        assert torch.equal(scale[..., 0], weight.abs().amax(-1) / 448)
        error = (dequantize_weight(q, scale) - weight).abs()
        bound = torch.maximum(weight.abs() * E4M3_HALF_ULP, scale * E4M3_SUBNORMAL_HALF_STEP)
        assert (error <= bound).all(), name
    # Embeddings, norms, routers and the LM head (fp8_lm_head off) keep their float weights.
    for name, weight in plain.named_parameters():
        if name not in quantized:
            assert torch.equal(params[name], weight), name
    if family == "sdar_moe":
        assert isinstance(fp8.layers[0].mlp.gate, torch.nn.Linear) and fp8.layers[0].mlp.gate.weight.dtype != FP8


def test_quantized_forward_is_the_float_forward_of_its_dequantized_weights(checkpoints):
    """The CPU path dequantizes in float32 and runs the float product: the same numbers as a float model that
    holds the dequantized weights."""
    fp8 = load_model(checkpoints["llada"], quantization="fp8")
    twin = load_model(checkpoints["llada"])
    with torch.no_grad():
        for name, module in fp8.named_modules():
            if isinstance(module, Fp8Linear):
                twin.get_submodule(name).weight.copy_(dequantize_weight(module.weight, module.weight_scale))
    assert torch.equal(prefill(fp8), prefill(twin))
    assert not torch.equal(prefill(fp8), prefill(load_model(checkpoints["llada"])))  # quantization did something


def test_fp8_lm_head_quantizes_the_head_and_stays_close(checkpoints):
    plain = load_model(checkpoints["llada"], quantization="fp8")
    with_head = load_model(checkpoints["llada"], quantization="fp8", fp8_lm_head=True)
    assert plain.lm_head.weight.dtype == torch.float32
    assert isinstance(with_head.lm_head, Fp8Linear) and with_head.lm_head.weight_scale.shape == (258, 1)
    want, got = prefill(plain), prefill(with_head)
    assert not torch.equal(got, want)
    # e4m3 rounds each weight by at most 2^-4 of itself; the logits move by a fraction of that.
    assert ((got - want).norm() / want.norm()).item() < 2**-4


@pytest.mark.parametrize("family,block,scale_dtype,per_tensor", [
    ("llada", None, torch.float32, False),  # per-channel weight_scale [N, 1]
    ("llada", None, torch.float32, True),  # one weight_scale per tensor
    ("llada", (128, 128), torch.bfloat16, False),  # Qwen3-FP8's blocks and bf16 scale_inv (one block of columns)
    ("llada", (32, 32), torch.float32, False),  # DeepSeek-V3's float32 scale_inv, blocks small enough to tile K
    ("dream", (32, 32), torch.float32, False),  # Qwen2's q/k/v biases stay in float beside the fp8 weights
    ("sdar_moe", (32, 32), torch.float32, False),  # experts stored one at a time, each with its scale_inv
], ids=["channel", "tensor", "block128-bf16", "block32", "dream-block32", "moe-block32"])
def test_released_fp8_checkpoint_computes_what_its_dequantized_weights_compute(
        checkpoints, tmp_path, family, block, scale_dtype, per_tensor):
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_pair(checkpoints[family], fp8_dir, float_dir, block, scale_dtype, per_tensor)
    fp8 = load_model(fp8_dir)
    params = dict(fp8.named_parameters())
    assert all(params[n].dtype == FP8 for n in projection_params(fp8))
    if block == (32, 32):  # K 64 or more in blocks of 32: scales per column group
        assert params["layers.0.attn.qkv_proj.weight_scale"].shape[-1] == fp8.arch.hidden_size // 32
    # float32 on both sides: the dequantized twin holds the same float32 products the fp8 path forms.
    assert torch.equal(prefill(fp8), prefill(load_model(float_dir)))


def test_engine_decodes_an_fp8_checkpoint_token_for_token_with_its_dequantized_twin(checkpoints, tmp_path):
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_pair(checkpoints["llada"], fp8_dir, float_dir, (32, 32))
    params = SamplingParams(max_tokens=12)
    prompts = ["fp8 weights", "a second prompt"]
    got = run_requests(tiny_engine(str(fp8_dir), dtype="float32"), prompts, params)
    want = run_requests(tiny_engine(str(float_dir), dtype="float32"), prompts, params)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert all(len(s.token_ids) > 0 for s in got)


@pytest.mark.parametrize("family", ["llada", "sdar_moe"])
def test_engine_with_quantization_fp8_decodes_like_a_float_model_of_the_same_weights(checkpoints, tmp_path, family):
    """quantization: fp8 reaches the engine's model, whose tokens are those of a float checkpoint holding its
    dequantized weights."""
    llm = tiny_engine(str(checkpoints[family]), dtype="float32", quantization="fp8")
    assert any(p.dtype == FP8 for p in llm.model.parameters())
    quantized = load_model(checkpoints[family], quantization="fp8")
    twin_dir = Path(shutil.copytree(checkpoints[family], tmp_path / "twin"))
    tensors = load_file(twin_dir / "model.safetensors")
    layout = quantized.checkpoint_layout()
    params = dict(quantized.named_parameters())
    for name, weight in layout.items():
        param = params[weight.param]
        if param.dtype == FP8:
            full = dequantize_weight(param, params[weight.param + "_scale"])
            tensors[name] = weight.target({weight.param: full}).contiguous()
    save_file(tensors, twin_dir / "model.safetensors", metadata={"format": "pt"})
    params_ = SamplingParams(max_tokens=12)
    got = run_requests(llm, ["quantized at load"], params_)
    want = run_requests(tiny_engine(str(twin_dir), dtype="float32"), ["quantized at load"], params_)
    assert got[0].token_ids == want[0].token_ids and got[0].token_ids


def edited_release(checkpoints, tmp_path, block=(32, 32), config_edit=None, tensor_edit=None) -> Path:
    fp8_dir = tmp_path / "fp8"
    write_fp8_pair(checkpoints["llada"], fp8_dir, tmp_path / "float", block)
    if config_edit:
        config = json.loads((fp8_dir / "config.json").read_text())
        config_edit(config["quantization_config"])
        (fp8_dir / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(fp8_dir / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    return fp8_dir


Q0 = "model.transformer.blocks.0.q_proj."


@pytest.mark.parametrize("edit,message", [
    (lambda qc: qc.update(quant_method="awq"), "has quant_method 'awq', which this engine does not load"),
    (lambda qc: qc.update(quant_method="compressed-tensors"), "has quant_method 'compressed-tensors'"),
    (lambda qc: qc.update(activation_scheme="static"), "has activation_scheme 'static': only 'dynamic'"),
    (lambda qc: qc.update(fmt="e5m2"), "has fmt 'e5m2': only 'e4m3'"),
    (lambda qc: qc.update(weight_block_size=[128]), "has weight_block_size [128]: expected two positive integers"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), "has keys ['kv_cache_scheme'] that this engine does not"),
    (lambda qc: qc.update(modules_to_not_convert=["model.transformer.blocks.0.q_proj"]),
     "keeps module 'model.transformer.blocks.0.q_proj' unquantized"),
], ids=["awq", "compressed-tensors", "static", "e5m2", "block-size", "unknown-key", "unquantized-projection"])
def test_a_scheme_that_is_not_loaded_is_refused_by_name(checkpoints, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(edited_release(checkpoints, tmp_path, config_edit=edit))


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop(Q0 + "weight_scale_inv"), f"missing weight '{Q0}weight_scale_inv'"),
    (_set(Q0 + "weight_scale_inv", torch.ones(3, 3)), f"scale '{Q0}weight_scale_inv' has shape (3, 3), expected (2, 2)"),
    (_set(Q0 + "weight_scale_inv", torch.tensor([[1.0, float("nan")], [1.0, 1.0]])),
     f"scale '{Q0}weight_scale_inv' holds a scale that is not a finite positive number"),
    (_set(Q0 + "weight_scale_inv", torch.tensor([[1.0, 0.0], [1.0, 1.0]])), "not a finite positive number"),
    (_set(Q0 + "weight_scale_inv", torch.tensor([[1.0, 1e300], [1.0, 1.0]], dtype=torch.float64)),
     "not a finite positive number in float32"),
    (_set(Q0 + "weight", torch.zeros(64, 64)),
     f"weight '{Q0}weight' is stored as F32, but config.json's 'quantization_config'"),
], ids=["missing", "misshapen", "nan", "zero", "past-float32", "float-weight"])
def test_a_scale_that_is_missing_misshapen_or_not_finite_is_refused_with_its_key(checkpoints, tmp_path, edit,
                                                                                   message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(edited_release(checkpoints, tmp_path, tensor_edit=edit))


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_an_fp8_weight_with_nan_bytes_is_refused_as_corrupt_whatever_family_reads_it(checkpoints, tmp_path, byte):
    """float8_e4m3fn's NaN is 0x7F and 0xFF; it has no infinities. A bad scale, like a bad weight, is the file's
    fault: neither message guesses at another family."""
    def nan_bytes(tensors):
        tensors[Q0 + "weight"].view(torch.uint8)[3, 5:7] = byte
    with pytest.raises(CorruptWeight, match=re.escape(f"weight '{Q0}weight' holds NaN or infinite values: 2 of the "
                                                      "4096 values read") + "$"):
        load_model(edited_release(checkpoints, tmp_path, tensor_edit=nan_bytes))
    scale_nan = _set(Q0 + "weight_scale_inv", torch.tensor([[1.0, float("nan")], [1.0, 1.0]]))
    with pytest.raises(CorruptWeight, match="not a finite positive number in float32$"):
        load_model(edited_release(checkpoints, tmp_path / "scale", tensor_edit=scale_nan))


@pytest.mark.parametrize("name,value,message", [
    (Q0 + "weight", torch.ones(64, 64, dtype=torch.int8),
     f"weight '{Q0}weight' is stored as I8; a weight loads from F16, BF16, F32, F64, or from F8_E4M3 "
     "(float8_e4m3fn) with a 'quantization_config'"),
    (Q0 + "weight_scale_inv", torch.ones(2, 2, dtype=torch.int32),
     f"scale '{Q0}weight_scale_inv' is stored as I32; a scale loads from F16, BF16, F32, F64"),
], ids=["integer-weight", "integer-scale"])
def test_integers_for_an_fp8_weight_or_its_scale_are_refused_as_corrupt(checkpoints, tmp_path, name, value,
                                                                         message):
    with pytest.raises(CorruptWeight, match=re.escape(message) + "$"):
        load_model(edited_release(checkpoints, tmp_path, tensor_edit=_set(name, value)))


def test_fp8_weights_without_a_quantization_config_are_refused(checkpoints, tmp_path):
    directory = edited_release(checkpoints, tmp_path, block=None)
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("weight_scale")}, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(
            "is stored as F8_E4M3 (float8_e4m3fn), but config.json has no 'quantization_config' with quant_method "
            "'fp8'")):
        load_model(directory)


def test_settings_refuse_an_unknown_quantization_and_a_lone_fp8_lm_head(checkpoints):
    with pytest.raises(ValueError, match=re.escape("config field 'quantization' must be one of [None, 'fp8']")):
        Config(model=str(checkpoints["llada"]), quantization="int8")
    with pytest.raises(ValueError, match=re.escape("config field 'fp8_lm_head' must be false unless quantization is "
                                                   "'fp8'")):
        Config(model=str(checkpoints["llada"]), fp8_lm_head=True)
    assert Config(model=str(checkpoints["llada"]), quantization="fp8", fp8_lm_head=True).fp8_lm_head


def test_fp8_on_a_gpu_older_than_ada_is_refused_before_loading(checkpoints, monkeypatch):
    """The capability check runs before any weight reaches the device: an A100 (8.0) is named with its version."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=re.escape("quantization 'fp8' needs a GPU of compute capability 8.9 or newer"
                                                   " (Ada, Hopper) for its FP8 products; NVIDIA A100-SXM4-80GB is 8.0")):
        load_model(checkpoints["llada"], quantization="fp8", device="cuda")


def test_a_merged_adapter_goes_into_the_weights_before_they_are_quantized(checkpoints, tmp_path):
    from diffulex_backend.model_setup import load_model_with_adapters
    from diffulex_backend.quantization import quantize_model
    from diffulex_backend.testing.checkpoint import write_peft_adapter

    adapter = str(write_peft_adapter(tmp_path / "adapter", checkpoints["llada"], ["q_proj", "ff_out"]))
    settings = dict(model=str(checkpoints["llada"]), lora_path=adapter, pre_merge_lora=True)
    merged_then_quantized, _ = load_model_with_adapters(Config(**settings, quantization="fp8"), torch.device("cpu"),
                                                        torch.float32)
    merged, _ = load_model_with_adapters(Config(**settings), torch.device("cpu"), torch.float32)
    quantize_model(merged)
    got, want = dict(merged_then_quantized.named_parameters()), dict(merged.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n].view(torch.uint8) if got[n].dtype == FP8 else got[n],
                           want[n].view(torch.uint8) if want[n].dtype == FP8 else want[n]) for n in got)


def test_an_fp8_checkpoint_refuses_a_merged_adapter(checkpoints, tmp_path):
    from diffulex_backend.testing.checkpoint import write_peft_adapter

    fp8_dir = edited_release(checkpoints, tmp_path)
    adapter = str(write_peft_adapter(tmp_path / "adapter", checkpoints["llada"], ["q_proj"]))
    with pytest.raises(ValueError, match=re.escape("config field 'lora_path' merges an adapter into the weights, but "
                                                   f"{fp8_dir} is an FP8 checkpoint; use lora_modules")):
        tiny_engine(str(fp8_dir), lora_path=adapter, pre_merge_lora=True)


def test_adapters_chosen_per_request_apply_beside_fp8_weights(checkpoints, tmp_path):
    """lora_modules on an FP8 model: a request with the adapter decodes what the merged float model of the
    dequantized weights plus the adapter decodes, and a request without it decodes the FP8 model alone."""
    from diffulex_backend.testing.checkpoint import write_peft_adapter

    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    write_fp8_pair(checkpoints["llada"], fp8_dir, float_dir)
    adapter = str(write_peft_adapter(tmp_path / "adapter", checkpoints["llada"], ["q_proj", "v_proj", "ff_out"],
                                     seed=2))
    prompt, plain, adapted = "adapters", SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, lora_name="a")
    llm = tiny_engine(str(fp8_dir), lora_modules={"a": adapter})
    got_plain, got_adapted = (run_requests(llm, [prompt], p)[0].token_ids for p in (plain, adapted))
    assert got_plain == run_requests(tiny_engine(str(float_dir)), [prompt], plain)[0].token_ids
    merged = tiny_engine(str(float_dir), lora_path=adapter, pre_merge_lora=True)
    assert got_adapted == run_requests(merged, [prompt], plain)[0].token_ids
    assert got_adapted != got_plain


def test_config_pbtxt_parameters_reach_the_served_models_weights(checkpoints):
    """quantization and fp8_lm_head as Triton hands them to the model (strings), through engine_settings."""
    from diffulex_backend.serving.engine_settings import engine_settings

    parameters = {"model": {"string_value": str(checkpoints["llada"])}, "quantization": {"string_value": "fp8"},
                  "fp8_lm_head": {"string_value": "true"}, "dtype": {"string_value": "float32"},
                  "max_model_len": {"string_value": "96"}, "max_num_reqs": {"string_value": "2"}}
    settings = engine_settings(parameters, model_dir=".")
    llm = tiny_engine(settings.pop("model"), **settings)
    assert isinstance(llm.model.lm_head, Fp8Linear) and isinstance(llm.model.layers[0].attn.qkv_proj, Fp8Linear)
    unset = engine_settings({**parameters, "quantization": {"string_value": ""},
                             "fp8_lm_head": {"string_value": "false"}}, model_dir=".")
    assert "quantization" not in unset  # an empty value leaves the field unset: the checkpoint's own weights
    assert not any(p.dtype == FP8 for p in tiny_engine(unset.pop("model"), **unset).model.parameters())
    with pytest.raises(ValueError, match=re.escape("config field 'quantization' must be one of [None, 'fp8']")):
        bad = engine_settings({**parameters, "quantization": {"string_value": "int4"}}, model_dir=".")
        Config(**bad)


# DiffusionGemma's checkpoints have a writer of their own (testing/diffusion_gemma_checkpoint.py), not ModelArch's.
@pytest.mark.parametrize("family", [name for name in AutoModelForDiffusionLM.keys() if name != "diffusion_gemma"])
def test_the_release_writer_quantizes_exactly_the_projections_each_family_loads_in_fp8(tmp_path, family):
    """The FP8 releases the tests load are written by fp8_checkpoints.py, whose projection names are its own: for
    every family that write_random_checkpoint writes, the weights it writes in fp8 are the checkpoint names of the
    parameters the engine quantizes, no more and no fewer, so that no family's fp8 tests pass over a projection left
    in float."""
    source = write_random_checkpoint(tmp_path / "float", family, seed=3, **(MOE if family == "sdar_moe" else {}))
    write_fp8_pair(source, tmp_path / "fp8", tmp_path / "twin")
    written = {name for name, tensor in load_file(tmp_path / "fp8" / "model.safetensors").items()
               if tensor.dtype == FP8}
    model = load_model(tmp_path / "fp8", model_name=family)  # Dream-Reasoner's config.json reads as Dream's
    quantized = set(fp8_params(model, lm_head=False))
    layout = model.checkpoint_layout()
    assert written and written == {name for name, weight in layout.items() if weight.param in quantized}
    assert all(dict(model.named_parameters())[p].dtype == FP8 for p in quantized)
