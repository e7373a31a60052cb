"""Every family and every decoding strategy served through a real tritonserver, with config.pbtxt's defaults (device
auto, so the GPU where there is one) and with an instance placed by instance_group: at batch 1, greedy, the served
tokens equal the in-process engine's with the same settings. The models have head size 64, which the Triton kernels
take, so on a GPU this is the path users run: fused kernels, CUDA graphs, the engine loop's threads on that GPU. On a
CPU the same requests check the same contract in float32."""

import json
from pathlib import Path

import pytest
import torch
from served import ids, post
from triton_server import STARTUP_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, TritonServer, add_model

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_peft_adapter, write_random_checkpoint
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint

# Head size 64: the Triton attention kernel's smallest; two layers keep the load short.
SHAPE = dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256)
# Small blocks so that a short answer spans several; a fixed KV cache, because sizing it from free GPU memory
# assumes one engine per GPU and this server holds one per model; few requests, so the warm-up is short.
SETTINGS = {"block_size": 4, "page_size": 4, "buffer_size": 2, "max_model_len": 256, "num_kv_pages": 256,
            "max_num_reqs": 4}
GPU_GROUP = "[{ kind: KIND_GPU, count: 1, gpus: [0] }]"
CPU_GROUP = "[{ kind: KIND_CPU, count: 1 }]"
PROMPT = list(range(3, 43))  # 40 tokens: ten pages, so that retention has pages to drop

# served model -> (family, engine settings beyond SETTINGS, request parameters beyond greedy decoding)
MODELS = {
    "llada_multi_bd_placed": ("llada", {}, {}),  # placed by instance_group (KIND_GPU on a GPU)
    "llada_vanilla": ("llada", {"decoding_strategy": "vanilla", "buffer_size": 1}, {}),
    "llada_fast_dllm": ("llada", {"decoding_strategy": "fast_dllm", "buffer_size": 1}, {}),
    "llada_lora": ("llada", {"lora_modules": "math={adapter}"}, {"lora_name": "math"}),
    "dream_d2f": ("dream", {"decoding_strategy": "d2f"}, {}),
    "sdar_retention": ("sdar", {}, {"retention_ratio": 0.5}),
    "llada2_dmax": ("llada2", {"decoding_strategy": "dmax", "model_name": "llada2_mini"}, {}),
    "sdar_moe_multi_bd": ("sdar_moe", {}, {}),
    "fast_dllm_v2": ("fast_dllm_v2", {"decoding_strategy": "fast_dllm_v2", "block_size": 8, "sub_block_size": 4,
                                      "buffer_size": 1, "accept_threshold": 0.3}, {}),
    # Named by model_name (their config.json says Dream), each with its family's default strategy spelled out:
    # config.pbtxt's own default would otherwise apply to the served engine and not to the one in process.
    "diffucoder_d2f": ("diffucoder", {"model_name": "diffucoder", "decoding_strategy": "d2f"}, {}),
    "dream_reasoner_multi_bd": ("dream_reasoner", {"model_name": "dream_reasoner", "decoding_strategy": "multi_bd"},
                                {}),
    "stable_diffcoder_multi_bd": ("stable_diffcoder", {}, {}),  # detected from config.json
    # SHAPE for its sliding layers (its full layers, window and MoE block are the writer's tiny ones), its canvas as
    # the block; greedy is the only temperature it accepts: the sampler's come from generation_config.json.
    "diffusion_gemma": ("diffusion_gemma", {"model_name": "diffusion_gemma", "decoding_strategy": "diffusion_gemma",
                                            "block_size": 8, "buffer_size": 1}, {}),
}
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    paths = {family: write_random_checkpoint(root / family, family, **SHAPE)
             for family in {family for family, _, _ in MODELS.values()} - {"diffusion_gemma"}}
    # Head sizes 64 and 128, both the attention kernel's: on a GPU both layer kinds run it, window and all.
    paths["diffusion_gemma"] = write_random_diffusion_gemma_checkpoint(root / "diffusion_gemma", seed=1,
                                                                       global_head_dim=128, **SHAPE)
    paths["adapter"] = write_peft_adapter(root / "adapter", paths["llada"], ["q_proj", "k_proj", "v_proj", "attn_out",
                                                                             "ff_proj", "up_proj", "ff_out"],
                                          rank=4, seed=1)
    return paths


def engine_settings(name: str, checkpoints: dict[str, Path]) -> dict:
    _, extra, _ = MODELS[name]
    settings = {**SETTINGS, **extra}
    if "lora_modules" in settings:
        settings["lora_modules"] = settings["lora_modules"].format(adapter=checkpoints["adapter"])
    return settings


@pytest.fixture(scope="module")
def families_server(tmp_path_factory, checkpoints):
    repository = tmp_path_factory.mktemp("families_repository")
    for name, (family, _, _) in MODELS.items():
        group = None
        if name.endswith("_placed"):
            group = GPU_GROUP if torch.cuda.is_available() else CPU_GROUP
        add_model(repository, name, model=checkpoints[family], instance_group=group,
                  **engine_settings(name, checkpoints))
    loads = [f"--load-model={name}" for name in MODELS]
    # A log of its own: the session's server writes repository.parent / "tritonserver.log".
    server = TritonServer(repository, repository.parent / "families-tritonserver.log",
                          ("--model-control-mode=explicit", *loads))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop(SHUTDOWN_TIMEOUT_S)
        raise
    yield server
    assert server.stop(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()


def as_config_value(value) -> object:
    """A config.pbtxt string as the engine takes it in Python."""
    return {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value


@pytest.mark.parametrize("name", list(MODELS))
def test_each_family_and_strategy_serves_the_in_process_engines_tokens(families_server, checkpoints, name):
    family, _, request = MODELS[name]
    params = {**GREEDY, **request}
    status, payload = post(f"{families_server.http_url}/v2/models/{name}/generate",
                           {"input_ids": PROMPT, "parameters": params, "return_finish_reason": True})
    assert status == 200, payload
    served = json.loads(payload)
    settings = {key: as_config_value(value) for key, value in engine_settings(name, checkpoints).items()}
    engine = Diffulex(str(checkpoints[family]), **settings)
    try:
        (expected,) = engine.generate([PROMPT], SamplingParams(**params))
    finally:
        engine.close()
    assert ids(served["output_ids"]) == expected.token_ids
    assert served["finish_reason"] == "length"
