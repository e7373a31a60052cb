"""How warm the offline API starts: the first `generate` after `Diffulex(...)` against the second, in one run.

`Diffulex(...)` warms itself up (warm_up.py) so that kernel compiles and CUDA graph captures happen before it
returns; without that, the first generate of 256 tokens at batch 1 on an H100 took several times the second. For
each batch size B: one engine, built and warmed as users build it, then two rounds of B fresh prompts of
--prompt-len tokens and --new-tokens new ones (greedy, ignore_eos); first / second is the warm start's cost. A
third engine row with --cold (warm_up=False) shows what the warm-up saves. Writes warm_start.csv and warm_start.md
to --out.

    python benchmarks/warm_start.py --out DIR                     # GPU: random LLaDA-8B, batches 1 and 32
    python benchmarks/warm_start.py --out DIR --checkpoint CKPT   # an existing checkpoint
    python benchmarks/warm_start.py --out DIR --smoke             # anywhere: a tiny model, batches 1 and 2
"""
from __future__ import annotations

import argparse
import csv
import random
import tempfile
import time
from pathlib import Path

import torch
from serving import free_memory, synchronize, write_checkpoint

from diffulex_backend import Diffulex, SamplingParams


def timed_generate(engine, prompts, params) -> float:
    synchronize()
    started = time.perf_counter()
    engine.generate(prompts, params)
    synchronize()
    return time.perf_counter() - started


def measure(checkpoint: Path, batch: int, prompt_len: int, new_tokens: int, warm_up: bool, settings: dict,
            seed: int) -> dict:
    started = time.perf_counter()
    engine = Diffulex(str(checkpoint), warm_up=warm_up, **settings)
    built = time.perf_counter() - started
    vocab = engine.model.arch.vocab_size
    rng = random.Random(seed)
    rounds = [[[rng.randrange(3, vocab - 1) for _ in range(prompt_len)] for _ in range(batch)] for _ in range(2)]
    for prompts in rounds:
        for prompt in prompts:  # no prompt holds the mask token
            prompt[:] = [t if t != engine.config.mask_token_id else t + 1 for t in prompt]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    first, second = (timed_generate(engine, prompts, params) for prompts in rounds)
    report = engine.warm_up_report
    del engine
    free_memory()
    # Four significant digits each: the ratio can be checked from the columns.
    return dict(batch=batch, warm_up=warm_up, build_s=float(f"{built:.4g}"),
                warm_up_s=float(f"{report.seconds:.4g}") if report else 0.0, first_s=float(f"{first:.4g}"),
                second_s=float(f"{second:.4g}"), first_over_second=float(f"{first / second:.4g}"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--cold", action="store_true", help="also an engine built with warm_up=False")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape, batches, prompt_len, new_tokens = (("tiny", (1, 2), 16, 16) if args.smoke else
                                              ("llada-8b", (1, 32), 256, 256))
    settings = dict(block_size=4, page_size=4, max_model_len=64, max_num_reqs=4) if args.smoke else {}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        checkpoint = args.checkpoint or write_checkpoint(Path(work) / "checkpoint", shape, device)
        if args.smoke:
            settings["device"] = "cpu"
        rows = [measure(checkpoint, batch, prompt_len, new_tokens, warm, settings, seed=batch)
                for batch in batches for warm in ((True, False) if args.cold else (True,))]
    with open(args.out / "warm_start.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| batch | warm-up | build s | warm-up s | first generate s | second generate s | first / second |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {'on' if r['warm_up'] else 'off'} | {r['build_s']} | {r['warm_up_s']} | "
              f"{r['first_s']} | {r['second_s']} | {r['first_over_second']} |" for r in rows]
    table = "\n".join(lines) + "\n"
    (args.out / "warm_start.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
