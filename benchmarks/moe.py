"""The fused MoE layer alone (`diffulex_kernels.fused_moe`, routing given) against its two floors and its torch twin.

- Touched-weight floor: the bytes of w_gate_up and w_down of the distinct experts the routing touches, read once at
  the HBM bandwidth measured in the same run. At a few tokens the layer is bound by this.
- Compute floor: 2 * T * K * 3 * H * I flops at the bf16 matmul rate measured in the same run (8192^3).
- The torch reference (`fused_moe_reference`, one expert at a time, float32), eager.

Routing is uniform: each token's K experts are the top K of random scores, so one block of 32 tokens x 8 choices
touches about 160 of 256 experts; `--eligible N` routes among N of them only, as a forward whose tokens reach fewer
experts does. The kernel is timed replayed from a CUDA graph with the L2 cache cleared before
each call (so the touched weights come from HBM, as in a forward), and launched from Python; `route ms` is the
sort-and-pad step alone, in a graph, and `gate_up ms`, `down ms` the two grouped GEMMs (the second with the
per-token sum) alone. `topk ms`, also in a graph, is the step before the layer: the model's group-limited top-k
(`select_experts` as the engine calls it, with the model's own routing) over random router logits, handed as the
router's streaming product hands them (float32 partial sums, as many as it splits K into, up to its MAX_TOKENS
rows). A few other tile shapes are timed beside the default plan.

With `--weights fp8` the stacks are float8_e4m3fn with a scale per row (what `quantization: fp8` writes) and the
products are fp8 ones (W8A8: the tokens cast per token, the act rows per row and group of 128 columns, as the engine
runs them), the touched-weight floor counts one byte a weight and the compute floor takes the fp8 matmul rate
(cuBLASLt, 8192^3) measured in the same run. `--weights fp8-weight-only` reads the same stacks into bf16 products
(W8A16), each weight widened in registers.

    PYTHONPATH=. python benchmarks/moe.py --out DIR     # GPU: LLaDA2-mini and Qwen3-30B-A3B (SDAR-30B-A3B) experts
    PYTHONPATH=. python benchmarks/moe.py --smoke --out DIR   # anywhere: tiny, one call each, checked against torch
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import pathlib
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import triton  # noqa: E402
from forward import fp8_matmul_rate  # noqa: E402  (benchmarks/forward.py)
from kernels import device_header, measure_ceilings, time_eager_ms, time_graph_ms  # noqa: E402  (benchmarks/kernels.py)

from diffulex_backend.layers.fp8_linear import quantize_weight  # noqa: E402
from diffulex_kernels.moe import (  # noqa: E402
    SILU, MoeLaunch, down_and_combine, fused_moe, fused_moe_reference, gate_up_act, plan_moe_launch, route_to_tiles,
)
from diffulex_kernels.fp8 import quantize_rows  # noqa: E402
from diffulex_kernels.linear import MAX_TOKENS, choose_split_k  # noqa: E402
from diffulex_backend.arch import ModelArch  # noqa: E402
from diffulex_backend.layers.moe import select_experts  # noqa: E402
from diffulex_backend.registry import AutoModelForDiffusionLM  # noqa: E402
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES, random_config  # noqa: E402


@dataclass(frozen=True)
class MoeShape:
    name: str
    experts: int
    hidden: int
    inter: int
    top_k: int
    arch: ModelArch  # the model's own, as the engine parses its config: its routing


def moe_shape(name: str, model_name: str, **config) -> MoeShape:
    """A model's MoE layer, from its config as the engine parses it."""
    arch = AutoModelForDiffusionLM.get(model_name).parse_config(random_config(model_name, **config), name)
    return MoeShape(name, arch.num_experts, arch.hidden_size, arch.moe_intermediate_size, arch.num_experts_per_tok,
                    arch)


# SDAR-30B-A3B's experts are Qwen3-30B-A3B's.
FULL_SHAPES = [moe_shape("LLaDA2-mini", **RELEASED_SHAPES["llada2-mini"]),
               moe_shape("Qwen3-30B-A3B", **RELEASED_SHAPES["sdar-30b-a3b"])]
FULL_TOKENS = (32, 256, 1024, 2048)
SMOKE_SHAPES = [moe_shape("tiny", "llada2", hidden_size=64, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, num_expert_groups=2, topk_groups=1)]
SMOKE_TOKENS = (4, 16)
# Tile shapes timed beside the default plan (the default is never timed twice).
VARIANTS = [MoeLaunch(16, 64, 128, 4, 4), MoeLaunch(16, 32, 128, 4, 4), MoeLaunch(16, 128, 64, 4, 4),
            MoeLaunch(32, 64, 128, 4, 4), MoeLaunch(64, 128, 64, 8, 3), MoeLaunch(128, 128, 64, 8, 3)]
# Weight-only fp8 stacks also try deeper tiles at decode, whose stages move the bytes of the 16-bit ones (on an H200
# at 32 tokens they are slower than the default: docs/kernels.md).
FP8_VARIANTS = [MoeLaunch(16, 64, 256, 4, 4), MoeLaunch(16, 64, 256, 4, 3), MoeLaunch(16, 128, 256, 4, 3),
                MoeLaunch(16, 64, 256, 8, 4), MoeLaunch(16, 32, 256, 4, 5), MoeLaunch(32, 64, 256, 4, 3)]
# W8A8's act groups are block_n columns, and the down product's K tile at most that. Narrower column tiles give a
# launch more programs where few experts are touched (a random LLaDA2-mini block touches about 60 a layer, against
# 160 under uniform routing), at the price of act groups, and so down's K tiles, of 64 columns.
W8A8_VARIANTS = [MoeLaunch(16, 64, 128, 4, 4), MoeLaunch(16, 64, 128, 4, 3), MoeLaunch(16, 64, 64, 4, 4),
                 MoeLaunch(16, 64, 64, 4, 6), MoeLaunch(16, 64, 256, 4, 4), MoeLaunch(16, 128, 256, 4, 3),
                 MoeLaunch(16, 128, 128, 4, 4), MoeLaunch(16, 128, 128, 4, 5), MoeLaunch(16, 128, 128, 8, 4),
                 MoeLaunch(16, 256, 128, 8, 3), MoeLaunch(32, 128, 128, 4, 3), MoeLaunch(32, 128, 128, 4, 4),
                 MoeLaunch(64, 128, 128, 4, 3), MoeLaunch(64, 128, 128, 8, 4), MoeLaunch(64, 128, 128, 8, 3),
                 MoeLaunch(128, 128, 128, 8, 3), MoeLaunch(64, 128, 256, 8, 3)]


def label(launch: MoeLaunch) -> str:
    return f"m{launch.block_m} n{launch.block_n} k{launch.block_k} w{launch.num_warps} s{launch.num_stages}"


WEIGHTS = ("bf16", "fp8", "fp8-weight-only")


def moe_case(shape: MoeShape, tokens: int, device: torch.device, weights: str, eligible: int | None = None):
    """(positional arguments of fused_moe, its keyword arguments): bf16 stacks, or fp8 ones with a scale per row.
    Each token's experts are the top K of random scores over all experts, or over `eligible` of them (a random
    subset, the same for every token)."""
    hidden = torch.randn(tokens, shape.hidden, device=device).to(torch.bfloat16)
    w_gate_up = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device) * 0.02).to(torch.bfloat16)
    w_down = (torch.randn(shape.experts, shape.hidden, shape.inter, device=device) * 0.02).to(torch.bfloat16)
    scores = torch.randn(tokens, shape.experts, device=device)
    if eligible is not None:
        barred = torch.ones(shape.experts, dtype=torch.bool, device=device)
        barred[torch.randperm(shape.experts, device=device)[:max(eligible, shape.top_k)]] = False
        scores[:, barred] = float("-inf")
    scores, topk_ids = scores.topk(shape.top_k, dim=1)
    options = {}
    if weights != "bf16":
        (w_gate_up, gate_up_scale), (w_down, down_scale) = quantize_weight(w_gate_up), quantize_weight(w_down)
        options = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale,
                       weight_only=weights == "fp8-weight-only")
    return (hidden, w_gate_up, w_down, topk_ids, torch.softmax(scores, dim=1)), options


def topk_stage(shape: MoeShape, tokens: int, device: torch.device):
    """The router's top-k over random logits, as the fused forward hands them: the streaming product's float32
    partial sums [S, T, E] up to MAX_TOKENS rows, else one product."""
    splits = choose_split_k(shape.experts, shape.hidden) if tokens <= MAX_TOKENS else 1
    partials = torch.randn(splits, tokens, shape.experts, device=device) / splits
    bias = torch.randn(shape.experts, device=device) * 1e-2 if shape.arch.router_bias else None
    return lambda: select_experts(partials, bias, shape.arch, fused=True)


def significant(ms: float) -> float:
    """Four significant digits: a tiny shape's floor on a GPU is a few nanoseconds, which four decimals make 0."""
    return float(f"{ms:.4g}")


def measure_fp8_rate(device: torch.device) -> float | None:
    """cuBLASLt's fp8 matmul rate (forward.py's measure, 8192^3), for W8A8's compute floor; None off a GPU."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    return fp8_matmul_rate(a, b, device, reps=10)


def bench_case(shape: MoeShape, tokens: int, device: torch.device, ceilings, fp8_rate: float | None, smoke: bool,
               weights: str, eligible: int | None = None) -> list[dict]:
    args, options = moe_case(shape, tokens, device, weights, eligible)
    w8a8 = weights == "fp8"
    touched = args[3].unique().numel()
    expert_bytes = 3 * shape.hidden * shape.inter * args[1].element_size()
    weight_floor_ms = 1e3 * touched * expert_bytes / ceilings.bandwidth
    rate = fp8_rate if w8a8 and fp8_rate else ceilings.matmul_rate
    compute_floor_ms = 1e3 * 2 * tokens * shape.top_k * 3 * shape.hidden * shape.inter / rate
    default = plan_moe_launch(tokens * shape.top_k, shape.experts, 1 if w8a8 else args[0].element_size())
    gate_up_scale, down_scale = options.get("w_gate_up_scale"), options.get("w_down_scale")
    if smoke:  # the smoke run also checks the product
        scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale) if gate_up_scale is not None else {}
        out = fused_moe(*args, **options)
        ref = fused_moe_reference(*args, **scales, act_group=default.block_n if w8a8 else None)
        error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        # Triton's interpreter casts to fp8 wrongly where rounding carries into the exponent (docs/kernels.md):
        # on the CPU the W8A8 product is only near its reference.
        bound = 0.25 if w8a8 and device.type == "cpu" else 1.5e-2
        assert error < bound, f"{shape.name} {weights} T={tokens}: relative error {error:.2e} against the reference"
    hidden, w_gate_up, w_down, topk_ids, topk_weights = args
    routed = route_to_tiles(topk_ids, shape.experts, default.block_m)
    x, x_scale = quantize_rows(hidden) if w8a8 else (hidden, None)
    act, act_scale = gate_up_act(x, w_gate_up, routed, shape.top_k, default, gate_up_scale, SILU, x_scale,
                                 hidden.dtype)
    stages_ms = [time_graph_ms(stage) for stage in (
        topk_stage(shape, tokens, device),
        lambda: route_to_tiles(topk_ids, shape.experts, default.block_m),
        lambda: gate_up_act(x, w_gate_up, routed, shape.top_k, default, gate_up_scale, SILU, x_scale, hidden.dtype),
        lambda: down_and_combine(act, w_down, topk_weights, routed, tokens, default, down_scale, act_scale,
                                 hidden.dtype),
    )]
    reference_ms = time_eager_ms(lambda: fused_moe_reference(*args)) if weights == "bf16" else math.nan
    rows = []
    variants = [] if smoke else {"bf16": VARIANTS, "fp8": W8A8_VARIANTS, "fp8-weight-only": VARIANTS + FP8_VARIANTS}[
        weights]
    for launch in dict.fromkeys([default] + variants):
        try:
            kernel_ms = time_graph_ms(lambda: fused_moe(*args, launch=launch, **options))
        except triton.runtime.errors.OutOfResources:
            continue  # the tile does not fit in shared memory
        eager_ms = time_eager_ms(lambda: fused_moe(*args, launch=launch, **options)) if launch == default else math.nan
        rows.append(dict(
            model=shape.name, weights=weights, tokens=tokens,
            launch=("default " if launch == default else "") + label(launch),
            touched_experts=touched, kernel_ms=significant(kernel_ms), eager_ms=significant(eager_ms),
            # The stages are timed for the default plan only.
            **{f"{name}_ms": significant(ms) if launch == default else math.nan
               for name, ms in zip(("topk", "route", "gate_up", "down"), stages_ms)},
            weight_floor_ms=significant(weight_floor_ms),
            compute_floor_ms=significant(compute_floor_ms), vs_weight_floor=round(kernel_ms / weight_floor_ms, 2),
            vs_compute_floor=round(kernel_ms / compute_floor_ms, 2),
            vs_larger_floor=round(kernel_ms / max(weight_floor_ms, compute_floor_ms), 2),
            reference_ms=significant(reference_ms), reference_vs_kernel=round(reference_ms / kernel_ms, 3),
        ))
        print(" | ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| model | weights | T | touched experts | kernel ms | weight floor ms | x weight floor | "
             "compute floor ms | x compute floor | x larger floor | topk / route / gate_up / down ms | eager ms | "
             "reference ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["launch"].startswith("default"):
            lines.append(f"| {r['model']} | {r['weights']} | {r['tokens']} | {r['touched_experts']} | "
                         f"{r['kernel_ms']:.4f} | {r['weight_floor_ms']:.4f} | {r['vs_weight_floor']:.2f} | "
                         f"{r['compute_floor_ms']:.4f} | {r['vs_compute_floor']:.2f} | {r['vs_larger_floor']:.2f} | "
                         f"{r['topk_ms']:.4f} / {r['route_ms']:.4f} / {r['gate_up_ms']:.3f} / {r['down_ms']:.3f} | "
                         f"{r['eager_ms']:.4f} | {r['reference_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one call each")
    parser.add_argument("--out", type=pathlib.Path, help="folder for moe.md and moe.csv")
    parser.add_argument("--weights", default="bf16", help=f"comma-separated, of {', '.join(WEIGHTS)}")
    parser.add_argument("--tokens", help=f"comma-separated token counts (default {','.join(map(str, FULL_TOKENS))})")
    parser.add_argument("--eligible", type=int, help="route among this many experts only (a random LLaDA2-mini "
                                                      "block's tokens reach about 60 of 256 a layer), not all")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    shapes, token_counts = (SMOKE_SHAPES, SMOKE_TOKENS) if args.smoke else (FULL_SHAPES, FULL_TOKENS)
    if args.tokens:
        token_counts = tuple(int(t) for t in args.tokens.split(","))
    weights = args.weights.split(",")
    if unknown := set(weights) - set(WEIGHTS):
        parser.error(f"--weights: {', '.join(sorted(unknown))} is none of {', '.join(WEIGHTS)}")
    ceilings = measure_ceilings(device, args.smoke)
    fp8_rate = measure_fp8_rate(device) if "fp8" in weights else None
    header = device_header(device, ceilings) + (f"; fp8 matmul {fp8_rate / 1e12:.0f} TFLOP/s" if fp8_rate else "")
    print(header, flush=True)
    rows = [row for kind in weights for shape in shapes for tokens in token_counts
            for row in bench_case(shape, tokens, device, ceilings, fp8_rate, args.smoke, kind, args.eligible)]
    table = format_table(rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe.md").write_text(f"{header}\n\n{table}\n")
        with open(args.out / "moe.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
