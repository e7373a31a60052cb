"""A random-weight DiffusionGemma checkpoint in the released layout: config.json with `text_config`,
generation_config.json with the sampler's settings, safetensors under `model.decoder.` names, and the byte-level
tokenizer of checkpoint.py. The released model's shape is far too large for tests; the default here is a few
layers of both attention kinds, with a window short enough that prompts cross it, and a MoE block.

CLI: python -m diffulex_backend.testing.diffusion_gemma_checkpoint OUT_DIR [--seed N] [--set KEY=JSON ...]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffulex_backend.models.diffusion_gemma import FULL, SLIDING, DenoiseSchedule, DiffusionGemmaModel
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID, TOKENIZER_VOCAB_SIZE, write_byte_tokenizer

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            global_head_dim=32, num_global_key_value_heads=1, intermediate_size=96, sliding_window=6,
            layer_types=[SLIDING, FULL, SLIDING, FULL], num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            max_position_embeddings=512, canvas_length=8)
# google/diffusiongemma-26B-A4B-it's text_config shape (25.2 B parameters, 3.8 B active): five sliding layers then a
# full one, five times; 128 experts, 8 a token, beside a dense MLP in every layer.
RELEASED_26B_A4B = dict(hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, global_head_dim=512, num_global_key_value_heads=2, intermediate_size=2112,
                        sliding_window=1024, layer_types=([SLIDING] * 5 + [FULL]) * 5, num_experts=128,
                        top_k_experts=8, moe_intermediate_size=704, vocab_size=262144,
                        max_position_embeddings=262144, canvas_length=256)
TINY_SCHEDULE = DenoiseSchedule(max_denoising_steps=6, t_min=0.4, t_max=0.8, entropy_bound=1.5, stability_threshold=1,
                                confidence_threshold=1.0)


# The released model carries a Gemma-4 vision tower, which the engine does not serve (its weights are left unread);
# its config stays in the file, at a tiny size.
TINY_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 16,
               "rms_norm_eps": 1e-6}

# checkpoint.py's shape arguments -> the text_config keys they set.
SHAPE_ARGUMENTS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                   "num_kv_heads": "num_key_value_heads"}


def tiny_config(**overrides) -> dict:
    """config.json of the tiny shape; overrides name text_config keys (or canvas_length, or checkpoint.py's shape
    arguments). A layer count without layer_types alternates sliding and full layers, ending with a full one."""
    overrides = {SHAPE_ARGUMENTS.get(k, k): v for k, v in overrides.items()}
    layers = overrides.get("num_hidden_layers")
    if layers is not None and "layer_types" not in overrides:
        overrides["layer_types"] = [FULL if (layers - 1 - i) % 2 == 0 else SLIDING for i in range(layers)]
    shape = {**TINY, **overrides}
    canvas = shape.pop("canvas_length")
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True, "bos_token_id": 2,
        "eos_token_id": [EOS_TOKEN_ID], "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": 0.02, "model_type": "diffusion_gemma_text", "pad_token_id": 0, "rms_norm_eps": 1e-6,
        "rope_parameters": {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                            SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}},
        "tie_word_embeddings": True, "use_bidirectional_attention": None, "vocab_size": TOKENIZER_VOCAB_SIZE,
        **shape,
    }
    if not text.get("num_experts"):
        text.update(num_experts=None, top_k_experts=None, moe_intermediate_size=None)
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "boi_token_id": 255999, "canvas_length": canvas,
            "dtype": "float32", "eoi_token_id": 258882, "image_token_id": 258880, "initializer_range": 0.02,
            "model_type": "diffusion_gemma", "text_config": text, "tie_word_embeddings": True,
            "transformers_version": "5.8.0.dev0", "vision_config": TINY_VISION}


def generation_config(schedule: DenoiseSchedule) -> dict:
    return {"max_denoising_steps": schedule.max_denoising_steps, "t_min": schedule.t_min, "t_max": schedule.t_max,
            "stability_threshold": schedule.stability_threshold,
            "confidence_threshold": schedule.confidence_threshold,
            "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": schedule.entropy_bound},
            "eos_token_id": [EOS_TOKEN_ID], "pad_token_id": 0, "bos_token_id": 2, "max_new_tokens": 256,
            "transformers_version": "5.8.0.dev0"}


def init_random_(model: DiffusionGemmaModel, seed: int) -> DiffusionGemmaModel:
    """Norms and scales near 1 (q/k norms near 2, so attention is not uniform), matrices with std 1/sqrt(fan_in),
    the tied embedding at a std that makes the logits peaky.

    Drawn where the model lives: in float64 on the CPU, so a tiny model's weights are the same in every dtype, and in
    float32 on a GPU, where the released shape's 25 B weights take seconds (the CPU would take many minutes)."""
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device).manual_seed(seed)
    draw = torch.float64 if device.type == "cpu" else torch.float32

    def randn(shape):
        return torch.randn(shape, generator=generator, dtype=draw, device=device)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(randn(param.shape) * 0.1 + 2.0)
            elif name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "layer_scalar", ".scale",
                                "per_expert_scale")):
                param.copy_(randn(param.shape) * 0.1 + 1.0)
            elif name == "embed_tokens.weight":
                param.copy_(randn(param.shape) * (6.0 / math.sqrt(param.shape[1])))
            else:
                param.copy_(randn(param.shape) / math.sqrt(param.shape[-1]))
    return model


def random_diffusion_gemma(config: dict, directory: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu") -> DiffusionGemmaModel:
    """The random model of `config` built directly on `device` in `dtype`, with no weights on disk: the model a
    benchmark runs at the released shape. `directory` holds (or will hold) its config.json."""
    arch = DiffusionGemmaModel.parse_config(config, Path(directory) / "config.json")
    return init_random_(DiffusionGemmaModel.empty(arch, None, dtype=dtype, device=device), seed)


def write_config_files(directory: Path, config: dict, schedule: DenoiseSchedule) -> None:
    """config.json, generation_config.json and the byte tokenizer: a checkpoint directory less its weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation_config(schedule), indent=2) + "\n")
    write_byte_tokenizer(directory, config["text_config"]["max_position_embeddings"])


def write_random_diffusion_gemma_checkpoint(path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                                           schedule: DenoiseSchedule = TINY_SCHEDULE, **overrides) -> Path:
    directory = Path(path)
    config = tiny_config(**overrides)
    config["dtype"] = str(dtype).removeprefix("torch.")
    write_config_files(directory, config, schedule)
    model = random_diffusion_gemma(config, directory, seed=seed, dtype=dtype)
    params = dict(model.named_parameters())
    tensors = {name: params[w.param].detach().clone() for name, w in model.checkpoint_layout().items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight DiffusionGemma checkpoint (tiny shape).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="set a text_config key (or canvas_length), e.g. --set sliding_window=16")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=JSON, got {item!r}")
        overrides[key] = json.loads(value)
    print(write_random_diffusion_gemma_checkpoint(args.out_dir, seed=args.seed, **overrides))


if __name__ == "__main__":
    main()
