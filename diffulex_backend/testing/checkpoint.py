"""Random-weight models in each family's real Hugging Face layout.

`write_random_checkpoint` writes a checkpoint directory that the loader (and any engine that reads the released
files) reads like a released one: config.json with the family's full key set, safetensors under the released
weight names (MoE experts one at a time; sharded with an index when asked, or when large), and a byte-level
tokenizer with an EOS and a mask token. `random_model` builds the same
model in memory, on any device and dtype, for benchmarks at the released shapes (`RELEASED_SHAPES`).
Both go through `random_config`, so a written checkpoint and an in-memory model of the same arguments and
seed on the same device hold the same weights.

CLI: python -m diffulex_backend.testing.checkpoint --family llada2 --shape llada2-mini OUT_DIR
     python -m diffulex_backend.testing.checkpoint --family llada OUT_DIR [--hidden-size 64 ...]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import diffulex_backend.models  # noqa: F401  (registers the families)
from diffulex_backend.attention import paged_attention_reference
from diffulex_backend.loader import detect_model_name
from diffulex_backend.arch import ModelArch
from diffulex_backend.models.decoder_lm import DecoderLM
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.testing.config_json import config_json

# The tokenizer: 256 byte tokens (id = byte value), then the special tokens.
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mdm_mask|>"
EOS_TOKEN_ID = 256
MASK_TOKEN_ID = 257
TOKENIZER_VOCAB_SIZE = 258

# Random weights that decode like a model rather than like noise: masked positions should disagree with each
# other, and their greedy confidence should spread from well under to well over the usual thresholds.
# - LOGIT_SCALE: the std of the logits, so softmax is peaky rather than ~1/V.
# - ATTENTION_SHARPNESS: the std of q and k entries, so attention scores have std ~ its square and each
#   position attends to a few others; positions then see different contexts and predict differently.
# - EMBEDDING_STD: small next to the attention output, so a run of identical mask tokens does not collapse
#   into one hidden state.
LOGIT_SCALE = 6.0
ATTENTION_SHARPNESS = 2.0
EMBEDDING_STD = 0.3

RELEASED_SHAPES = {
    "llada-8b": dict(model_name="llada", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                     intermediate_size=12288, vocab_size=126464, max_position_embeddings=4096),
    "dream-7b": dict(model_name="dream", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                     intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072),
    # Fast_dLLM_v2_7B: the Qwen2.5-7B-Instruct shape.
    "fast_dllm_v2-7b": dict(model_name="fast_dllm_v2", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                            intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                            rope_theta=1000000.0, rms_norm_eps=1e-6),
    # DiffuCoder-7B: Qwen2.5-Coder-7B's shape, which is Qwen2.5-7B's.
    "diffucoder-7b": dict(model_name="diffucoder", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                          intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072,
                          rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Stable-DiffCoder-8B: Seed-Coder-8B's shape.
    "stable_diffcoder-8b": dict(model_name="stable_diffcoder", hidden_size=4096, num_layers=32, num_heads=32,
                                num_kv_heads=8, intermediate_size=14336, vocab_size=155136,
                                max_position_embeddings=32768, rope_theta=500000.0, rms_norm_eps=1e-6),
    # DreamReasoner-8B: Qwen3-8B's shape (q/k norms come with the family).
    "dream_reasoner-8b": dict(model_name="dream_reasoner", hidden_size=4096, num_layers=36, num_heads=32,
                              num_kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                              max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "sdar-8b": dict(model_name="sdar", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                    head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=32768),
    # LLaDA2.0-mini and LLaDA2.1-mini: 16 B parameters, 1.4 B active.
    "llada2-mini": dict(model_name="llada2", hidden_size=2048, num_layers=20, num_heads=16, num_kv_heads=4,
                        head_dim=128, intermediate_size=5120, vocab_size=157184, max_position_embeddings=32768,
                        rope_theta=600000.0, rms_norm_eps=1e-6, qk_norm=True, partial_rotary_factor=0.5,
                        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, num_shared_experts=1,
                        dense_layers=(0,), num_expert_groups=8, topk_groups=4, routed_scaling_factor=2.5),
    # SDAR-30B-A3B: the Qwen3-30B-A3B shape.
    "sdar-30b-a3b": dict(model_name="sdar_moe", hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                         head_dim=128, intermediate_size=6144, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}

# ModelArch fields beyond the dense shape that `random_config` takes as arguments (the rest of its keyword
# arguments are config.json keys); a family's RANDOM_ARCH gives their defaults.
ARCH_ARGUMENTS = frozenset({
    "rope_theta", "rms_norm_eps", "qk_norm", "partial_rotary_factor", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "num_shared_experts", "dense_layers", "num_expert_groups", "topk_groups",
    "routed_scaling_factor", "norm_topk_prob",
})
# Shards of a written checkpoint hold about this many bytes, as released checkpoints do.
SHARD_BYTES = 4 << 30


def random_config(
    model_name: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    **extra_config,
) -> dict:
    """The family's config.json for this shape; `extra_config` overrides or adds config.json keys, except the
    names in ARCH_ARGUMENTS, which set ModelArch fields (a MoE family's routing, say)."""
    family = AutoModelForDiffusionLM.get(model_name)
    arch_fields = dict(rope_theta=10000.0, rms_norm_eps=1e-5, **family.RANDOM_ARCH)
    arch_fields.update({k: extra_config.pop(k) for k in list(extra_config) if k in ARCH_ARGUMENTS})
    arch = ModelArch(
        model_name=model_name,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size or TOKENIZER_VOCAB_SIZE,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        mask_token_id=MASK_TOKEN_ID,
        eos_token_ids=(EOS_TOKEN_ID,),
        shifted=False,
        block_size=None,
        **arch_fields,
    )
    return {**config_json(AutoModelForDiffusionLM.canonical(model_name), arch), **extra_config}


def init_random_(model: DecoderLM, seed: int) -> DecoderLM:
    """Fill every parameter from one seeded generator, in parameter order.

    Linear weights have std 1/sqrt(fan_in) (times ATTENTION_SHARPNESS for q and k), so activations keep
    their scale through the layers. Norm weights sit near 1 (near ATTENTION_SHARPNESS for q/k norms) and
    biases near 0, but not at them, so a test notices one that is dropped.
    """
    arch = model.arch
    qk_rows = arch.q_size + arch.kv_size  # the q and k rows of the fused qkv projection
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            generator = generators.get(param.device)
            if generator is None:
                generator = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(ATTENTION_SHARPNESS, 0.1, generator=generator)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.1, generator=generator)
            elif name.endswith((".bias", "expert_bias")):
                param.normal_(0.0, 0.1, generator=generator)
            elif name == "lm_head.weight" or (name == "embed_tokens.weight" and model.lm_head is None):
                param.normal_(0.0, LOGIT_SCALE / math.sqrt(arch.hidden_size), generator=generator)
            elif name == "embed_tokens.weight":
                param.normal_(0.0, EMBEDDING_STD, generator=generator)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=generator)  # [(E,) out, in]
                if name.endswith("qkv_proj.weight") and not arch.qk_norm:
                    param[:qk_rows] *= ATTENTION_SHARPNESS
    return model


def build_random_model(
    model_name: str,
    config: dict,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    attention_fn=paged_attention_reference,
) -> DecoderLM:
    family = AutoModelForDiffusionLM.get(model_name)
    arch = family.parse_config(config, f"<random {model_name} config>")
    return init_random_(family.empty(arch, attention_fn, dtype=dtype, device=device), seed)


def random_model(
    model_name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attention_fn=paged_attention_reference,
    **shape_and_config,
) -> DecoderLM:
    """A random-weight model built directly on `device` in `dtype`, e.g.
    `random_model(**RELEASED_SHAPES["llada-8b"], dtype=torch.bfloat16, device="cuda")`."""
    config = random_config(model_name, **shape_and_config)
    return build_random_model(model_name, config, dtype=dtype, device=device, seed=seed, attention_fn=attention_fn)


def write_random_checkpoint(
    path: str | Path,
    model_name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_shards: int | None = 1,
    tokenizer: bool = True,
    device: str | torch.device = "cpu",
    **shape_and_config,
) -> Path:
    """A checkpoint directory in the family's real layout; `shape_and_config` as for `random_config`.
    num_shards None: as many shards of about SHARD_BYTES as the weights need (one file when they fit).
    `device` is where the weights are drawn: a GPU writes a released-shape model in seconds where the CPU takes
    minutes, and its weights are those of `random_model` on that device."""
    directory = Path(path)
    config = random_config(model_name, **shape_and_config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    model = build_random_model(model_name, config, dtype=dtype, device=device, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(model, directory, num_shards)
    if tokenizer:
        write_byte_tokenizer(directory, model.arch.max_position_embeddings)
    return directory


def write_weights(model: DecoderLM, directory: Path, num_shards: int | None) -> None:
    """Safetensors under the checkpoint names: model.safetensors, or num_shards files and an index."""
    params = dict(model.named_parameters())
    layout = model.checkpoint_layout()
    names = list(layout)
    total_size = sum(math.prod(w.shape) * params[w.param].element_size() for w in layout.values())
    if num_shards is None:
        num_shards = max(1, math.ceil(total_size / SHARD_BYTES))

    def tensors(chunk: list[str]) -> dict[str, torch.Tensor]:
        # Clone: fused parameters are split into views of one storage, which safetensors refuses to save. One
        # shard at a time, so a released-shape model is not held twice in memory.
        return {name: layout[name].target(params).detach().to("cpu", copy=True) for name in chunk}

    if num_shards == 1:
        save_file(tensors(names), directory / "model.safetensors", metadata={"format": "pt"})
        return
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in [1, {len(names)}] for this model, got {num_shards}")
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[shard * len(names) // num_shards:(shard + 1) * len(names) // num_shards]
        save_file(tensors(chunk), directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_peft_adapter(
    path: str | Path,
    checkpoint: str | Path,
    target_modules: list[str],
    *,
    rank: int = 4,
    lora_alpha: float = 8.0,
    use_rslora: bool = False,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """A LoRA adapter for `checkpoint` as PEFT's save_pretrained writes it: adapter_config.json, and
    adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
    [out, r] for every layer module whose checkpoint name ends in a name of `target_modules` (q_proj, ff_out, ...).
    B is random, not PEFT's zeros, so that the adapter changes the model's outputs. `config_overrides` add or
    replace adapter_config.json keys."""
    directory, source = Path(path), Path(checkpoint)
    config = json.loads((source / "config.json").read_text())
    family = AutoModelForDiffusionLM.get(detect_model_name(config, source / "config.json"))
    model = family.empty(family.parse_config(config, source), paged_attention_reference, dtype=torch.float32,
                         device="meta")
    generator = torch.Generator().manual_seed(seed)
    scale = lora_alpha / (math.sqrt(rank) if use_rslora else rank)
    tensors = {}
    for name, weight in model.checkpoint_layout().items():
        module = name.removesuffix(".weight")
        is_layer = any(name.startswith(family.LAYER_PREFIX.format(i)) for i in range(model.arch.num_layers))
        if not (is_layer and name.endswith(".weight") and module.rsplit(".", 1)[-1] in target_modules):
            continue
        out_features, in_features = weight.shape
        # The delta scale · B · A moves each output by about a third of the weight's own contribution.
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(
            rank, in_features, generator=generator) / math.sqrt(in_features)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(
            out_features, rank, generator=generator) * (0.3 / (scale * math.sqrt(rank)))
    adapter_config = {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": str(source), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layers_pattern": None,
        "layers_to_transform": None, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "modules_to_save": None,
        "peft_type": "LORA", "r": rank, "rank_pattern": {}, "revision": None, "target_modules": list(target_modules),
        "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": use_rslora, **config_overrides,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    return directory


def byte_alphabet() -> list[str]:
    """The printable character that byte-level pre-tokenization maps each byte value to (index = byte).

    Bytes that print as themselves keep their character; the others are moved, in order, to code points
    from 256 up, so that every byte has a visible, non-whitespace stand-in.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = {}
    moved = 0
    for byte in range(256):
        if byte in printable:
            stand_ins[byte] = chr(byte)
        else:
            stand_ins[byte] = chr(256 + moved)
            moved += 1
    return [stand_ins[byte] for byte in range(256)]


def write_byte_tokenizer(directory: Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json: one token per UTF-8 byte (no merges,
    so a multi-byte character is several tokens and any text round-trips), plus EOS and mask."""
    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False),
                            AddedToken(MASK_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID and tok.token_to_id(MASK_TOKEN) == MASK_TOKEN_ID
    tok.save(str(directory / "tokenizer.json"))
    special = {"eos_token": EOS_TOKEN, "mask_token": MASK_TOKEN, "pad_token": EOS_TOKEN}
    added = {
        str(token_id): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for content, token_id in ((EOS_TOKEN, EOS_TOKEN_ID), (MASK_TOKEN, MASK_TOKEN_ID))
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        **special,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    # DiffusionGemma's two head shapes and window are not ModelArch's: diffusion_gemma_checkpoint.py writes it.
    families = [name for name in AutoModelForDiffusionLM.keys() if name != "diffusion_gemma"]
    shapes = {**RELEASED_SHAPES, **{f"{name}-tiny": dict(model_name=name) for name in families}}
    parser = argparse.ArgumentParser(description="Write a random-weight checkpoint in a family's released layout.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", "--model-name", dest="model_name", choices=families,
                        help="the model family (default: the --shape's)")
    parser.add_argument("--shape", choices=sorted(shapes),
                        help="a released shape, or FAMILY-tiny; the flags below override single fields")
    for flag in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "intermediate-size", "head-dim",
                 "vocab-size", "max-position-embeddings"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 for a released shape, else float32")
    parser.add_argument("--num-shards", type=int, default=None,
                        help=f"default: shards of about {SHARD_BYTES >> 30} GiB (one file when the weights fit)")
    parser.add_argument("--no-tokenizer", action="store_true")
    parser.add_argument("--device", default="cpu",
                        help="where the weights are drawn: cuda writes a released shape in seconds (the weights differ "
                             "from the CPU's for the same seed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="set a config.json key, e.g. --set block_size=8 --set tie_word_embeddings=true")
    args = parser.parse_args(argv)
    spec = dict(shapes[args.shape]) if args.shape else {}
    family = spec.pop("model_name", None)
    if args.model_name and family and args.model_name != family:
        parser.error(f"--shape {args.shape} is a {family!r} shape, not {args.model_name!r}")
    family = args.model_name or family
    if family is None:
        parser.error("give --family or --shape")
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "head_dim",
                  "vocab_size", "max_position_embeddings"):
        if getattr(args, field) is not None:
            spec[field] = getattr(args, field)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=JSON, got {item!r}")
        try:
            spec[key] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"--set {key}: {value!r} is not JSON (quote strings: {key}='\"text\"')")
    dtype = args.dtype or ("bfloat16" if args.shape in RELEASED_SHAPES else "float32")
    out = write_random_checkpoint(args.out_dir, family, seed=args.seed, dtype=getattr(torch, dtype),
                                  num_shards=args.num_shards, tokenizer=not args.no_tokenizer, device=args.device,
                                  **spec)
    print(out)


if __name__ == "__main__":
    main()
