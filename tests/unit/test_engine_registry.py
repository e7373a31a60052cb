"""Registries: strategies and model families are found by name or alias, a default strategy exists, and an
unknown name is an error that lists what is registered."""
from __future__ import annotations

import dataclasses
import re

import pytest

from diffulex_backend import Config, SamplingParams
from diffulex_backend.registry import STRATEGIES as STRATEGY_TABLE
from diffulex_backend.registry import AutoModelForDiffusionLM, Registry, register_strategy
from engine_driver import run_requests, tiny_engine

STRATEGIES = ["d2f", "diffusion_gemma", "dmax", "fast_dllm", "fast_dllm_v2", "multi_bd", "vanilla"]


def test_every_strategy_is_registered():
    assert STRATEGY_TABLE.keys() == STRATEGIES


def test_unknown_strategy_error_lists_the_registered_keys():
    message = f"strategies: unknown decoding_strategy 'nope'; registered: {STRATEGIES}"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        STRATEGY_TABLE.get("nope")


def test_unknown_strategy_in_the_config_lists_the_registered_keys(llada_checkpoint):
    with pytest.raises(ValueError, match=re.escape(f"must be one of {STRATEGIES}, got 'nope'")):
        Config(model=llada_checkpoint, decoding_strategy="nope")


def test_an_unset_strategy_is_the_named_familys_default(llada_checkpoint):
    assert Config(model=llada_checkpoint).decoding_strategy == "multi_bd"
    assert Config(model=llada_checkpoint, model_name="dream").decoding_strategy == "multi_bd"
    assert Config(model=llada_checkpoint, model_name="diffucoder").decoding_strategy == "d2f"
    assert Config(model=llada_checkpoint, model_name="diffucoder", decoding_strategy="bd").decoding_strategy == "multi_bd"
    assert Config(model=llada_checkpoint, model_name="gpt2").decoding_strategy == "multi_bd"  # refused at load


def test_unknown_model_name_error_lists_the_registered_families(llada_checkpoint):
    message = ("config field 'model_name' must be one of ['diffucoder', 'diffusion_gemma', 'dream', 'dream_reasoner', "
               "'fast_dllm_v2', 'llada', 'llada2', 'sdar', 'sdar_moe', 'stable_diffcoder'] or null, got 'gpt2'")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        tiny_engine(llada_checkpoint, model_name="gpt2")


@pytest.mark.parametrize("alias, name", [
    ("bd", "multi_bd"), ("block_diffusion", "multi_bd"), ("diffusion_forcing", "d2f"), ("llada", "vanilla"),
    ("fastdllm", "fast_dllm"), ("fast-dllm", "fast_dllm"), ("fast-dllm-v2", "fast_dllm_v2"),
])
def test_an_alias_resolves_to_its_strategy(llada_checkpoint, alias, name):
    assert Config(model=llada_checkpoint, decoding_strategy=alias).decoding_strategy == name
    assert STRATEGY_TABLE.get(alias) is STRATEGY_TABLE.get(name)


def test_an_alias_decodes_like_its_strategy(llada_checkpoint):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    by_alias = run_requests(tiny_engine(llada_checkpoint, decoding_strategy="bd"), ["hello"], params)[0]
    by_name = run_requests(tiny_engine(llada_checkpoint, decoding_strategy="multi_bd"), ["hello"], params)[0]
    assert by_alias.token_ids == by_name.token_ids


def test_the_default_strategy_is_multi_bd_and_decodes(llada_checkpoint):
    assert STRATEGY_TABLE.canonical(None) == "multi_bd"
    llm = tiny_engine(llada_checkpoint)  # no decoding_strategy given
    assert llm.config.decoding_strategy == "multi_bd"
    out = run_requests(llm, ["hello"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_a_strategy_and_its_alias_cannot_be_registered_twice():
    record = STRATEGY_TABLE.get("multi_bd")
    with pytest.raises(ValueError, match="^strategies: decoding_strategy 'multi_bd' is registered twice$"):
        register_strategy(record)
    with pytest.raises(ValueError, match="^strategies: decoding_strategy 'block_diffusion' is registered twice$"):
        register_strategy(dataclasses.replace(record, name="another"))
    assert STRATEGY_TABLE.keys() == STRATEGIES


def test_model_families_are_registered_by_name():
    assert AutoModelForDiffusionLM.keys() == ["diffucoder", "diffusion_gemma", "dream", "dream_reasoner", "fast_dllm_v2", "llada", "llada2", "sdar", "sdar_moe", "stable_diffcoder"]


def test_a_registry_refuses_a_key_or_alias_twice_and_without_default_says_so():
    registry: Registry = Registry("AutoThing", "decoding_strategy")
    registry.register("one", aliases=("uno",))(object)
    for key in ("one", "uno"):
        with pytest.raises(ValueError, match=f"^AutoThing: decoding_strategy '{key}' is registered twice$"):
            registry.register(key)(object)
    with pytest.raises(ValueError, match=r"^AutoThing: no default decoding_strategy; registered: \['one'\]$"):
        registry.get(None)
