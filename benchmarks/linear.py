"""The layer matmuls of one forward at a few tokens: cuBLAS (`F.linear`) against the engine's weight-streaming kernel
(`diffulex_kernels.linear`), each product in the engine's form: qkv whole, gate_up with SiLU-and-mul in its epilogue
(against cuBLAS followed by the SiLU-and-mul kernel), o_proj and down_proj as split-K partial sums. Every matrix of
every layer is its own tensor, so each one is read from HBM, as in a forward. On a GPU the whole chain is one CUDA
graph, timed by its replays; `MAX_TOKENS` is where the kernel stops paying.

    PYTHONPATH=. python benchmarks/linear.py --out DIR      # GPU: LLaDA-8B and Dream-7B layer shapes
    PYTHONPATH=. python benchmarks/linear.py --smoke --out DIR   # anywhere: tiny, eager, checked against F.linear
"""
from __future__ import annotations

import argparse
import csv
import os
import pathlib

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from diffulex_kernels.activation import silu_and_mul  # noqa: E402
from diffulex_kernels.linear import MAX_TOKENS, linear, linear_partials, linear_silu_and_mul  # noqa: E402
from forward import graph_replay_ms, wall_ms  # noqa: E402

# How the engine calls each product.
WHOLE, PARTIALS, GATED = "whole", "split-K partials", "SiLU-and-mul epilogue"
# (layers, [(out features, in features, form)]) per model: qkv, o_proj, gate_up, down_proj.
SHAPES = {"llada-8b": (32, [(12288, 4096, WHOLE), (4096, 4096, PARTIALS), (24576, 4096, GATED), (4096, 12288, PARTIALS)]),
          "dream-7b": (28, [(4608, 3584, WHOLE), (3584, 3584, PARTIALS), (37888, 3584, GATED), (3584, 18944, PARTIALS)])}
SMOKE_SHAPES = {"tiny": (2, [(96, 64, WHOLE), (64, 96, PARTIALS), (128, 64, GATED)])}


def library_product(x: torch.Tensor, weight: torch.Tensor, form: str) -> torch.Tensor:
    product = F.linear(x, weight)
    return silu_and_mul(product) if form == GATED else product


def engine_product(x: torch.Tensor, weight: torch.Tensor, form: str) -> torch.Tensor:
    if form == PARTIALS:
        return linear_partials(x, weight)  # the partial sums stay apart: the engine's next norm adds them as it reads
    return linear_silu_and_mul(x, weight) if form == GATED else linear(x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, eager, on any device")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    # Fixed inputs: the smoke run's check compares two bf16 roundings of the same products, and an unlucky draw
    # (a gated product near a SiLU zero) could put a random run past its bound now and then.
    torch.manual_seed(0)
    shapes, token_counts = (SMOKE_SHAPES, (4, 16)) if args.smoke else (SHAPES, (16, 32, 48, 64, 96))
    if not args.smoke:  # an idle GPU starts at low clocks
        square = torch.randn(8192, 8192, device=device, dtype=dtype)
        for _ in range(200):
            square @ square
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, (layers, matrices) in shapes.items():
        weights = [[torch.randn(n, k, device=device, dtype=dtype) for n, k, _ in matrices] for _ in range(layers)]
        weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
        for tokens in token_counts:
            inputs = {k: torch.randn(tokens, k, device=device, dtype=dtype) for _, k, _ in matrices}

            def chain(engine: bool):
                products = []
                for layer in weights:
                    for (_, k, form), weight in zip(matrices, layer):
                        product = engine_product if engine else library_product
                        products.append(product(inputs[k], weight, form))
                return products

            if not args.smoke:
                library_ms = graph_replay_ms(lambda: chain(False), device, reps=10)
                engine_ms = graph_replay_ms(lambda: chain(True), device, reps=10)
            else:
                library_ms, engine_ms = wall_ms(lambda: chain(False), device), wall_ms(lambda: chain(True), device)
                for got, want in zip(chain(True), chain(False)):  # the smoke run also checks the products
                    got = got.sum(0) if got.dim() == 3 else got
                    error = (got.float() - want.float()).norm() / want.float().norm()
                    assert error < 1e-2, f"{model} {tokens} tokens: relative error {error:.2e} against cuBLAS"
            rows.append(dict(model=model, tokens=tokens, kernel="streaming" if tokens <= MAX_TOKENS else "cuBLAS",
                             cublas_ms=f"{library_ms:.4g}", engine_ms=f"{engine_ms:.4g}",
                             engine_vs_cublas=f"{engine_ms / library_ms:.4g}",
                             engine_tb_per_s=f"{weight_bytes / engine_ms / 1e9:.3g}"))
            print(" | ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        del weights
    with open(args.out / "linear.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out / 'linear.csv'}")


if __name__ == "__main__":
    main()
