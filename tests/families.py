"""Every family and decoding strategy as the tests build them: a tiny checkpoint in the family's real layout, at
head size 64 (the Triton kernels' smallest, so that on a GPU the fused forward and its CUDA graphs run), and the
engine settings and request parameters each model is served with."""
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffulex_backend.testing.checkpoint import write_peft_adapter, write_random_checkpoint
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint

SHAPE = dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256)
ADAPTER_MODULES = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]
# Every value of an overflowing adapter: finite in float32 and bfloat16, so a model loads it, but a forward under it
# overflows (A · x, then times B, passes their largest value, 3.4e38), so its requests' logits are NaN.
ENORMOUS = 1e30

# model -> (family, engine settings, request parameters beyond greedy decoding)
MODELS = {
    "llada_multi_bd_placed": ("llada", {}, {}),  # placed by instance_group (KIND_GPU on a GPU) where served
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


def write_checkpoint(directory: Path, family: str) -> Path:
    """The family's tiny checkpoint at SHAPE."""
    if family == "diffusion_gemma":
        # Head sizes 64 and 128, both the attention kernel's: on a GPU both layer kinds run it, window and all.
        return write_random_diffusion_gemma_checkpoint(directory, seed=1, global_head_dim=128, **SHAPE)
    return write_random_checkpoint(directory, family, **SHAPE)


def write_adapter(directory: Path, checkpoint: Path) -> Path:
    """A rank-4 adapter over every projection of a LLaDA checkpoint, for the models whose settings name one."""
    return write_peft_adapter(directory, checkpoint, ADAPTER_MODULES, rank=4, seed=1)


def write_overflowing_adapter(directory: Path, checkpoint: Path) -> Path:
    """write_adapter's adapter with every value ENORMOUS."""
    weights = write_adapter(directory, checkpoint) / "adapter_model.safetensors"
    save_file({key: torch.full_like(tensor, ENORMOUS) for key, tensor in load_file(weights).items()}, weights)
    return directory


def model_settings(name: str, adapter: Path | None) -> dict:
    """The engine settings of model `name`, its adapter's path in place."""
    _, settings, _ = MODELS[name]
    if "lora_modules" in settings:
        settings = {**settings, "lora_modules": settings["lora_modules"].format(adapter=adapter)}
    return settings
