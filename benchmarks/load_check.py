"""What the loader's check that the weights are finite costs at load, at LLaDA2-mini's expert count.

The loader copies each expert of each MoE layer into its stacked device parameter, one piece at a time (19 MoE
layers of 256 experts, three pieces an expert: gate, up, down; 14592 pieces). This copies that many pieces from host
memory (gate, up and down as three stacks, where the model fuses gate and up into one), in bf16 and in fp8, three
ways in one run:
  - none: the copies alone;
  - each piece: `non_finite_count` after each copy, which waits on the device once a piece;
  - whole parameters: the loader's way, `is_finite` over each stacked parameter once its pieces are in, and one wait
    for them all (`loader._check_finite`).
Each way runs once to warm up, then `--rounds` times, the order reversed every other round. Seconds are for all the
pieces. Writes load_check.csv/.md to --out. Needs a CUDA GPU.

    PYTHONPATH=. python3 benchmarks/load_check.py --out DIR
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

from diffulex_backend.loader import is_finite, non_finite_count
from result_table import ResultTable

LAYERS, EXPERTS = 19, 256
PIECES = ((512, 2048), (512, 2048), (2048, 512))  # gate, up and down of one LLaDA2-mini expert
WAYS = ("none", "each piece", "whole parameters")


def load(sources: list[torch.Tensor], params: list[torch.Tensor], way: str) -> float:
    """Seconds to copy every piece of every layer into `params` (one layer's stacked experts, reused by each layer)
    and check them `way`."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    finite = []
    for _ in range(LAYERS):
        for expert in range(EXPERTS):
            for source, param in zip(sources, params):
                param[expert].copy_(source)
                if way == "each piece":
                    assert non_finite_count(param[expert]) == 0
        if way == "whole parameters":
            finite += [is_finite(param) for param in params]
    if finite:
        assert torch.stack(finite).all()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("load_check", ["dtype", "way", "round", "pieces", "seconds"])
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        sources = [torch.randn(shape).to(dtype) for shape in PIECES]
        params = [torch.empty((EXPERTS, *shape), dtype=dtype, device="cuda") for shape in PIECES]
        for way in WAYS:
            load(sources, params, way)
        for round_ in range(args.rounds):
            for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
                table.add(dtype=str(dtype).removeprefix("torch."), way=way, round=round_,
                          pieces=LAYERS * EXPERTS * len(PIECES), seconds=load(sources, params, way))
        del params
    table.write(args.out, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
