"""Config: every field is validated with a message that names it and what it allows, impossible combinations
are refused, and the fields reach the engine."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from diffulex_backend import Config, Diffulex, SamplingParams
from diffulex_backend.loader import CheckpointError
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID as EOS_ID, MASK_TOKEN_ID
from engine_driver import run_requests, tiny_engine

# One invalid value per field, and the message it must give.
INVALID = {
    "model": ("", "a path to a checkpoint directory"),
    "model_name": (5, "a registered model name or null"),
    "decoding_strategy": ("nope", "one of ['d2f', 'diffusion_gemma', 'dmax', 'fast_dllm', 'fast_dllm_v2', 'multi_bd', 'vanilla']"),
    "sampling_mode": ("greedy", "one of ['threshold', 'topk']"),
    "block_size": (0, "an integer >= 1 and <= 2147483647"),
    "buffer_size": (0, "an integer >= 1 and <= 2147483647"),
    "page_size": (2.0, "an integer >= 1 and <= 2147483647"),
    "max_model_len": (1, "an integer >= 2 and <= 2147483647"),
    "max_num_batched_tokens": (0, "an integer >= 1 and <= 2147483647"),
    "max_num_reqs": (0, "an integer >= 1 and <= 2147483647"),
    "num_kv_pages": (0, "an integer >= 1 and <= 2147483647"),
    "gpu_memory_utilization": (0.0, "a number in (0, 1]"),
    "enable_prefix_caching": ("yes", "true or false"),
    "enforce_eager": (1, "true or false"),
    "attention_backend": ("flash", "one of ['auto', 'torch', 'triton', 'flash_attn']"),
    "device": ("tpu", "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    "dtype": ("int8", "one of ['auto', 'float32', 'bfloat16', 'float16', 'float64']"),
    "accept_threshold": (1.5, "a number in [0, 1]"),
    "remask_threshold": (-0.1, "a number in [0, 1]"),
    "add_block_threshold": ("0.5", "a number in [0, 1]"),
    "semi_complete_threshold": (True, "a number in [0, 1]"),
    "mask_token_id": (-1, "an integer >= 0 and <= 2147483647"),
    "dual_cache": ("no", "true or false"),
    "cache_refresh_interval": (-1, "an integer >= 0 and <= 2147483647"),
    "sub_block_size": (0, "an integer >= 1 and <= 2147483647"),
    "token_merge_mode": ("soft", "one of ['dmax_topk', 'iter_smooth_topk']"),
    "token_merge_top_k": (0, "an integer >= 1 and <= 2147483647"),
    "token_merge_renormalize": ("yes", "true or false"),
    "token_merge_weight": (1.5, "a number in [0, 1]"),
    "edit_threshold": (-0.1, "a number in [0, 1]"),
    "retention_ratio": (0, "a number in (0, 1]"),
    "head_select": ("yes", "true or false"),
    "tensor_parallel_size": (65, "at most 64 (one process per rank)"),
    "expert_parallel": (True, "false unless tensor_parallel_size is above 1 (it splits experts over ranks)"),
    "seed": (-1, "an integer >= 0"),
    "lora_path": ("", "an adapter directory"),
    "pre_merge_lora": ("yes", "true or false"),
    "lora_modules": (5, "name=path pairs separated by commas"),
    "max_loras": (0, "an integer >= 1"),
    "max_lora_rank": (True, "an integer >= 1"),
    "quantization": ("int4", "one of [None, 'fp8'] (null: the checkpoint's own weights)"),
    "fp8_lm_head": ("yes", "true or false"),
    "kv_cache_dtype": ("fp16", "one of ['auto', 'fp8']"),
    "profile_dir": (5, "a writable directory or null"),
}


def raises_exactly(message):
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize("field", sorted(INVALID))
def test_invalid_value_names_the_field_and_what_it_allows(llada_checkpoint, field):
    value, allowed = INVALID[field]
    with raises_exactly(f"config field '{field}' must be {allowed}, got {value!r}"):
        Config(**{"model": llada_checkpoint, field: value})


def test_every_config_field_has_an_invalid_value_case():
    assert sorted(INVALID) == sorted(Config.field_names())


@pytest.mark.parametrize("fields, message", [
    (dict(decoding_strategy="d2f", enable_prefix_caching=True),
     "config field 'enable_prefix_caching' must be false for decoding_strategy 'd2f': its prompt K/V depend on "
     "later tokens"),
    (dict(decoding_strategy="vanilla", enable_prefix_caching=True),
     "config field 'enable_prefix_caching' must be false for decoding_strategy 'vanilla': its prompt K/V depend on "
     "later tokens"),
    (dict(decoding_strategy="vanilla", buffer_size=2),
     "config field 'buffer_size' must be <= 1 for decoding_strategy 'vanilla', got 2"),
    (dict(decoding_strategy="fast_dllm", buffer_size=2),
     "config field 'buffer_size' must be <= 1 for decoding_strategy 'fast_dllm', got 2"),
    (dict(decoding_strategy="multi_bd", dual_cache=True),
     "config field 'dual_cache' applies to decoding_strategy 'fast_dllm' only, not 'multi_bd'; leave it at its "
     "default (False)"),
    (dict(decoding_strategy="d2f", cache_refresh_interval=2),
     "config field 'cache_refresh_interval' applies to decoding_strategy 'fast_dllm' only, not 'd2f'; leave it at "
     "its default (0)"),
    (dict(decoding_strategy="multi_bd", token_merge_top_k=2),
     "config field 'token_merge_top_k' applies to decoding_strategy 'dmax' only, not 'multi_bd'; leave it at its "
     "default (1)"),
    (dict(decoding_strategy="fast_dllm", add_block_threshold=0.5),
     "config field 'add_block_threshold' applies to decoding_strategy 'd2f' and 'dmax' and 'multi_bd' only, not "
     "'fast_dllm'; leave it at its default (0.1)"),
    (dict(decoding_strategy="vanilla", sub_block_size=4),
     "config field 'sub_block_size' applies to decoding_strategy 'fast_dllm_v2' only, not 'vanilla'; leave it at "
     "its default (8)"),
    (dict(block_size=32, buffer_size=2, max_num_batched_tokens=64),
     "config field 'max_num_batched_tokens' must be >= 96 for decoding_strategy 'multi_bd' (the blocks in flight "
     "plus the block being committed), got 64"),
    (dict(decoding_strategy="vanilla", max_model_len=128, max_num_batched_tokens=64),
     "config field 'max_num_batched_tokens' must be >= 128 for decoding_strategy 'vanilla' (tokens of one "
     "request's largest forward), got 64"),
    (dict(block_size=2**63),
     "config field 'block_size' must be an integer >= 1 and <= 2147483647, got 9223372036854775808"),
    (dict(max_num_batched_tokens=2**31), "config field 'max_num_batched_tokens' must be an integer >= 1 and <= "
                                         "2147483647, got 2147483648"),
    (dict(device="cuda:01"), "config field 'device' must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:01'"),
    (dict(device="cuda:\u0663"), "config field 'device' must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:\u0663'"),
    (dict(remask_threshold=0.5),
     "config field 'remask_threshold' must be 0.0 for decoding_strategy 'multi_bd' at buffer_size 1: it acts on the "
     "blocks after the first in flight, and a request predicts one block a step"),
    (dict(decoding_strategy="vanilla", remask_threshold=0.5),
     "config field 'remask_threshold' must be 0.0 for decoding_strategy 'vanilla': it acts on the blocks after the "
     "first in flight, and a request predicts one block a step"),
    (dict(decoding_strategy="d2f", semi_complete_threshold=0.5),
     "config field 'semi_complete_threshold' must be 0.9 for decoding_strategy 'd2f' at buffer_size 1: it acts on "
     "the blocks after the first in flight, and a request predicts one block a step"),
])
def test_impossible_combinations_are_refused(llada_checkpoint, fields, message):
    with raises_exactly(message):
        Config(model=llada_checkpoint, **fields)


WITHOUT_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="states what a machine without CUDA does")


@pytest.mark.parametrize("fields, message", [
    pytest.param(dict(device="cuda"), "config field 'device' is 'cuda', but no CUDA device is available",
                 marks=WITHOUT_CUDA),
    pytest.param(dict(attention_backend="triton"),
                 "config field 'attention_backend' is 'triton', which needs a CUDA device; use 'torch' on CPU",
                 marks=WITHOUT_CUDA),
    pytest.param(dict(attention_backend="flash_attn"),
                 "config field 'attention_backend' is 'flash_attn', which needs a CUDA device; use 'torch' on CPU",
                 marks=WITHOUT_CUDA),
    (dict(device="cpu", max_model_len=1024),
     "config field 'max_model_len' must be <= the model's max_position_embeddings (512), got 1024"),
    (dict(device="cpu", max_model_len=64, mask_token_id=258),
     "config field 'mask_token_id' must be < vocab_size (258), got 258"),
    (dict(device="cpu", mask_token_id=EOS_ID),
     f"config field 'mask_token_id' is {EOS_ID}, an end-of-sequence token of this model (eos ids [{EOS_ID}]); the "
     "mask token must be one the model never outputs"),
    (dict(device="cpu", decoding_strategy="dmax", token_merge_top_k=259),
     "config field 'token_merge_top_k' must be <= vocab_size (258), got 259"),
    (dict(device="cpu", num_kv_pages=2),
     "config field 'num_kv_pages' (2) holds fewer pages than the warm-up's longest request takes (3 of 96 tokens): "
     "raise it (the offline API also loads with warm_up=False)"),
])
def test_settings_the_machine_or_checkpoint_cannot_honour_are_refused(llada_checkpoint, fields, message):
    with raises_exactly(message):
        Diffulex(llada_checkpoint, **fields)


def test_a_config_is_frozen_and_fills_only_what_its_strategy_decides(llada_checkpoint):
    config = Config(model=llada_checkpoint, decoding_strategy="bd")
    assert (config.decoding_strategy, config.sampling_mode, config.enable_prefix_caching) == ("multi_bd", "threshold",
                                                                                             True)
    assert Config(model=llada_checkpoint, decoding_strategy="vanilla").sampling_mode == "topk"
    # What the checkpoint decides stays unset until an engine reads it.
    assert (config.model_name, config.mask_token_id, config.max_model_len) == (None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8


def test_the_engine_holds_a_resolved_copy_with_max_model_len_from_the_checkpoint(llada_checkpoint):
    llm = tiny_engine(llada_checkpoint, max_model_len=None)
    assert (llm.config.model_name, llm.config.mask_token_id, llm.config.max_model_len) == ("llada", MASK_TOKEN_ID, 512)
    assert llm.metrics().kv_pages_total == llm.config.max_num_reqs * 512 // llm.config.page_size


def test_a_strategy_check_that_needs_the_checkpoint_runs_once_it_is_read(llada_checkpoint):
    with raises_exactly("config field 'max_num_batched_tokens' must be >= 512 for decoding_strategy 'vanilla' (tokens "
                        "of one request's largest forward), got 128"):
        tiny_engine(llada_checkpoint, decoding_strategy="vanilla", max_model_len=None)


def test_an_empty_model_name_is_refused_by_name(llada_checkpoint):
    with raises_exactly("config field 'model_name' must be a registered model name or null, got ''"):
        Config(model=llada_checkpoint, model_name="")


def test_model_name_is_detected_and_a_wrong_one_names_the_file(llada_checkpoint):
    assert tiny_engine(llada_checkpoint).config.model_name == "llada"
    with pytest.raises(CheckpointError, match=re.escape(f"{llada_checkpoint}/config.json: missing required config key")):
        tiny_engine(llada_checkpoint, model_name="dream")


def test_mask_token_id_is_detected_and_an_explicit_one_is_used(llada_checkpoint):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    auto = tiny_engine(llada_checkpoint)
    assert auto.config.mask_token_id == 257  # the tokenizer's <|mdm_mask|>, named in config.json
    explicit = tiny_engine(llada_checkpoint, mask_token_id=0)
    # The generation area starts as the mask token, so the model sees other inputs and predicts other tokens.
    assert run_requests(explicit, ["hello"], params)[0].token_ids != run_requests(auto, ["hello"], params)[0].token_ids


def test_kv_pool_size_comes_from_num_kv_pages_else_from_the_limits(llada_checkpoint):
    assert tiny_engine(llada_checkpoint, num_kv_pages=7).metrics().kv_pages_total == 7
    # On CPU, without num_kv_pages: room for max_num_reqs sequences of max_model_len.
    assert tiny_engine(llada_checkpoint, max_num_reqs=3, max_model_len=96, page_size=8).metrics().kv_pages_total == 36


def test_engine_seed_makes_unseeded_sampling_reproducible(llada_checkpoint):
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0)

    def sample(seed):
        return run_requests(tiny_engine(llada_checkpoint, seed=seed), ["hello"], params)[0].token_ids

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


@WITHOUT_CUDA
def test_explicit_cpu_device_and_torch_attention_give_the_automatic_choice(llada_checkpoint):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    auto = run_requests(tiny_engine(llada_checkpoint, device="auto", attention_backend="auto"), ["hello"], params)[0]
    explicit = run_requests(tiny_engine(llada_checkpoint, device="cpu", attention_backend="torch"), ["hello"], params)[0]
    assert explicit.token_ids == auto.token_ids


def test_auto_attention_takes_the_kernels_on_a_gpu_only_for_the_head_sizes_they_serve():
    from diffulex_backend.attention import paged_attention_reference
    from diffulex_backend.model_setup import resolve_attention
    from diffulex_backend.models.decoder_lm import DecoderLM
    from diffulex_backend.models.diffusion_gemma import DiffusionGemmaModel
    from diffulex_kernels.attention import HEAD_DIMS, paged_attention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only compared by type: nothing runs on them here
    fused, gemma = DecoderLM.KERNEL_HEAD_DIMS, DiffusionGemmaModel.KERNEL_HEAD_DIMS
    assert set(fused) < set(gemma) == set(HEAD_DIMS)
    assert resolve_attention("auto", cuda, (128,), fused) is paged_attention
    assert resolve_attention("auto", cuda, (16,), fused) is paged_attention_reference  # a tiny model still serves
    # Wider heads take the kernel where only the attention is the kernel's (DiffusionGemma's two layer kinds).
    assert resolve_attention("auto", cuda, (256,), fused) is paged_attention_reference
    assert resolve_attention("auto", cuda, (256, 512), gemma) is paged_attention
    assert resolve_attention("auto", cuda, (16, 512), gemma) is paged_attention_reference
    assert resolve_attention("auto", cpu, (128,), fused) is paged_attention_reference
    assert resolve_attention("torch", cuda, (128,), fused) is paged_attention_reference
    with raises_exactly("config field 'attention_backend' is 'triton', whose kernels take head_dim (64, 128); "
                        "this model's is 16: use 'torch' or 'auto'"):
        resolve_attention("triton", cuda, (16,), fused)
    with raises_exactly("config field 'attention_backend' is 'triton', whose kernels take head_dim "
                        "(64, 128, 256, 512); this model's is (16, 512): use 'torch' or 'auto'"):
        resolve_attention("triton", cuda, (16, 512), gemma)


def test_flash_attn_is_refused_by_name_where_it_cannot_serve_the_model():
    from diffulex_backend.flash_attention import refusal

    bf16 = torch.bfloat16
    assert refusal(None, bf16, (128,), False) == "which needs a CUDA device; use 'torch' on CPU"
    assert refusal((8, 0), bf16, (128,), False) == ("whose kernels need compute capability 9.0 or newer; this GPU "
                                                     "has 8.0")
    assert refusal((9, 0), torch.float32, (128,), False) == ("which computes in bfloat16 or float16; this engine's "
                                                              "dtype is float32")
    assert refusal((9, 0), bf16, (16,), False) == "taken here at head_dim (64, 128); this model's is 16"
    assert refusal((9, 0), bf16, (256, 512), False) == "taken here at head_dim (64, 128); this model's is (256, 512)"
    assert refusal((9, 0), bf16, (128,), True) == ("which takes no sliding window here; this model has windowed "
                                                    "layers")



def test_a_path_setting_takes_a_path_object_as_its_text(llada_checkpoint, tmp_path):
    from pathlib import Path

    config = Config(model=Path(llada_checkpoint), profile_dir=tmp_path)
    assert (config.model, config.profile_dir) == (llada_checkpoint, str(tmp_path))
    assert Diffulex(Path(llada_checkpoint), warm_up=False, device="cpu").config.model == llada_checkpoint


def test_float64_takes_the_torch_attention_on_a_gpu_and_the_triton_backend_refuses_it_by_name():
    """float64 is a reference dtype that no kernel takes: "auto" gives it the torch path on a GPU too (the choice
    needs no GPU to run)."""
    from diffulex_backend.attention import paged_attention_reference
    from diffulex_backend.model_setup import resolve_attention

    cuda = torch.device("cuda")
    assert resolve_attention("auto", cuda, (128,), dtype=torch.float64) is paged_attention_reference
    with raises_exactly("config field 'attention_backend' is 'triton', whose kernels take float32, bfloat16 and "
                        "float16; dtype 'float64' runs on 'torch' or 'auto'"):
        resolve_attention("triton", cuda, (128,), dtype=torch.float64)


def test_a_kv_cache_larger_than_the_machine_is_refused_before_it_is_allocated(llada_checkpoint):
    with pytest.raises(ValueError, match=r"^config field 'num_kv_pages' \(2147483647\): 2147483647 KV pages of \d+ "
                                         r"bytes \(.* GiB\) do not fit the .* GiB of cpu$"):
        Diffulex(llada_checkpoint, warm_up=False, device="cpu", num_kv_pages=2**31 - 1)
    with pytest.raises(ValueError, match=r"^config fields 'max_num_reqs' \(2147483647\) and 'max_model_len' \(512\) "
                                         r"size the KV cache where 'num_kv_pages' is unset: "):
        Diffulex(llada_checkpoint, warm_up=False, device="cpu", max_num_reqs=2**31 - 1)
