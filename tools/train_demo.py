"""Train a demo diffusion model on the addition task (tools/demo_task.py) and write it as a checkpoint in its
family's Hugging Face layout, loadable by the engine like a released model.

    python tools/train_demo.py llada model_repository/diffulex/demo-llada   # LLaDA layout, full attention
    python tools/train_demo.py sdar checkpoints/demo-sdar                   # SDAR layout, block-causal

The model is the engine's own module (diffulex_backend.models), run over padded [B, L] batches through an
attention function that applies an explicit [B, L, L] mask, so training and serving share every layer.

Recipes (see demo_objectives.py for the objectives):
  llada  every other step FULL (generated areas of 8 to 128 tokens, so any max_tokens decodes) and BLOCK
         (block sizes 4 to 32, causal prompt), so one checkpoint serves vanilla and fast_dllm as well as
         multi_bd, the Triton model's default strategy.
  sdar   BLOCK only, at the block_size written to its config.json.

Seeded: the same arguments on the same device give the same checkpoint up to GPU reduction order.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from demo_objectives import Objective, TrainingBatch, block_batch, full_batch
from demo_task import GEN_LENGTH, encode_answers, encode_prompts, sample_training_pairs
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, random_config, write_byte_tokenizer, write_weights
from diffulex_backend.models.decoder_lm import DecoderLM
from diffulex_backend.registry import AutoModelForDiffusionLM

MAX_POSITION_EMBEDDINGS = 512  # the Triton model's max_model_len
INIT_STD = 0.02


@dataclass(frozen=True)
class Recipe:
    model_name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    objectives: tuple[Objective, ...]  # cycled step by step
    full_gen_lengths: tuple[int, ...]  # FULL: generated-area lengths, drawn uniformly per step
    block_gen_lengths: tuple[int, ...]  # BLOCK: generated-area lengths
    block_sizes: tuple[int, ...]  # BLOCK: block sizes (and FULL's semi-autoregressive cut blocks)
    config_block_size: int | None = None  # written to config.json (SDAR)


RECIPES = {
    "llada": Recipe("llada", hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=6, intermediate_size=512,
                    objectives=(Objective.FULL, Objective.BLOCK),
                    full_gen_lengths=(GEN_LENGTH, GEN_LENGTH, GEN_LENGTH, 16, 32, 64, 128),
                    block_gen_lengths=(GEN_LENGTH, 16, 32), block_sizes=(4, 8, 16, 32)),
    "sdar": Recipe("sdar", hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=3, intermediate_size=512,
                   objectives=(Objective.BLOCK,), full_gen_lengths=(), block_gen_lengths=(GEN_LENGTH, 16),
                   block_sizes=(4,), config_block_size=4),
}


class MaskedAttention:
    """The model's attention function for training: dense attention under `self.mask` ([B, L, L]), which the
    training loop sets before each forward. Same signature as diffulex_backend.attention's functions."""

    def __init__(self):
        self.mask: torch.Tensor | None = None

    def __call__(self, query, key, value, k_cache, v_cache, meta, scale):  # [T, H(kv), D] each, T = B * L
        batch, length = self.mask.shape[:2]
        heads, kv_heads = query.shape[1], key.shape[1]

        def split(x):  # [T, h, D] -> [B, h, L, D]
            return x.view(batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

        q, k, v = split(query), split(key), split(value)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:, None], scale=scale)
        return out.transpose(1, 2).reshape(batch * length, heads, -1)


def build_model(recipe: Recipe, attention: MaskedAttention, device: torch.device, seed: int) -> tuple[DecoderLM, dict]:
    extra = {} if recipe.config_block_size is None else {"block_size": recipe.config_block_size}
    config = random_config(recipe.model_name, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
                           num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads,
                           intermediate_size=recipe.intermediate_size,
                           max_position_embeddings=MAX_POSITION_EMBEDDINGS, **extra)
    family = AutoModelForDiffusionLM.get(recipe.model_name)
    arch = family.parse_config(config, f"<{recipe.model_name} demo config>")
    model = family.empty(arch, attention, dtype=torch.float32, device=device).requires_grad_(True)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD)
    return model, config


def make_batch(recipe: Recipe, step: int, batch_size: int, generator: torch.Generator, device,
               all_masked: bool = False) -> TrainingBatch:
    objective = recipe.objectives[step % len(recipe.objectives)]
    lengths = recipe.full_gen_lengths if objective == Objective.FULL else recipe.block_gen_lengths
    gen_length = lengths[int(torch.randint(len(lengths), (1,), generator=generator, device=device))]
    block_size = recipe.block_sizes[int(torch.randint(len(recipe.block_sizes), (1,), generator=generator, device=device))]
    a, b = sample_training_pairs(batch_size, generator, device)
    prompt, prompt_len = encode_prompts(a, b)
    answer = encode_answers(a, b, gen_length)
    build = full_batch if objective == Objective.FULL else block_batch
    return build(prompt, prompt_len, answer, MASK_TOKEN_ID, generator, block_size, all_masked)


def loss_and_exact_match(model: DecoderLM, attention: MaskedAttention, batch: TrainingBatch):
    """The weighted masked-diffusion loss, and the fraction of rows whose every masked token is argmax-right."""
    attention.mask = batch.attention_mask
    hidden = model(batch.input_ids.flatten(), batch.positions.flatten(), None, None)  # [B * L, hidden]
    scored = batch.loss_weight.flatten() > 0
    logits = model.compute_logits(hidden[scored]).float()  # [N, vocab]
    targets = batch.targets.flatten()[scored]
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * batch.loss_weight.flatten()[scored]).sum() / batch.num_predicted
    wrong = torch.zeros(batch.input_ids.numel(), dtype=torch.bool, device=logits.device)
    wrong[scored] = logits.argmax(-1) != targets
    exact = 1.0 - wrong.view(batch.input_ids.shape).any(dim=1).float().mean()
    return loss, exact


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def write_checkpoint(model: DecoderLM, config: dict, out: Path, summary: dict) -> None:
    """config.json, model.safetensors (bfloat16: half the bytes, and the engine casts on load), tokenizer,
    and training.json (the recipe, the arguments and the loss history)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16), out, num_shards=1)
    write_byte_tokenizer(out, MAX_POSITION_EMBEDDINGS)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")


def train(args: argparse.Namespace) -> None:
    recipe = RECIPES[args.model_name]
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    attention = MaskedAttention()
    model, config = build_model(recipe, attention, device, args.seed)
    generator = torch.Generator(device).manual_seed(args.seed)
    eval_generator = torch.Generator(device).manual_seed(args.seed + 1)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98),
                                  fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{recipe.model_name}: {num_params / 1e6:.2f}M parameters on {device}", flush=True)
    start = time.monotonic()
    history = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        batch = make_batch(recipe, step, args.batch_size, generator, device)
        with autocast:
            loss, _ = loss_and_exact_match(model, attention, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # Exact match with the whole generated area masked: one forward, every answer token at once.
            with torch.no_grad(), autocast:
                exact = {}
                for k, objective in enumerate(recipe.objectives):
                    eval_batch = make_batch(recipe, k, args.eval_batch_size, eval_generator, device, all_masked=True)
                    exact[objective.value] = round(float(loss_and_exact_match(model, attention, eval_batch)[1]), 4)
            history.append({"step": step + 1, "loss": round(loss.item(), 4), "one_forward_exact_match": exact,
                            "seconds": round(time.monotonic() - start, 1)})
            print(json.dumps(history[-1]), flush=True)
            # Written at every log line, so an interrupted run still leaves its latest weights.
            summary = {"recipe": {**asdict(recipe), "objectives": [o.value for o in recipe.objectives]},
                       "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                       "num_parameters": num_params, "device": str(device), "torch_version": torch.__version__,
                       "steps_done": step + 1, "history": history}
            write_checkpoint(model, config, args.out, summary)
    print(f"wrote {args.out}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a demo diffusion model on multi-digit addition.")
    parser.add_argument("model_name", choices=sorted(RECIPES))
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--eval-batch-size", type=int, default=1024, help="problems of the exact-match log")
    train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
