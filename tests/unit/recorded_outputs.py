"""What every model family decodes under every decoding strategy, recorded once and held against later code.

`outputs(root)` writes each family's tiny random checkpoint under `root`, and runs the same requests through every
strategy the family is paired with: greedy and seeded-sampled requests, one stopped by a stop string, one by EOS.
Per request it keeps the token ids, the finish reason and the forward passes (nfe); a pairing the engine refuses
keeps the refusal's message. test_recorded_outputs.py compares the engine of the day with the committed record,
recorded_outputs.json, so a restructuring is held to the code before it and not to itself.

    python tests/unit/recorded_outputs.py --record     # rewrite recorded_outputs.json from this checkout
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.registry import STRATEGIES, AutoModelForDiffusionLM
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint

RECORD = Path(__file__).with_name("recorded_outputs.json")
SETTINGS = dict(block_size=4, page_size=4, buffer_size=2, max_model_len=96, max_num_batched_tokens=128,
                dtype="float64", device="cpu", accept_threshold=0.5, warm_up=False)
# Fast-dLLM v2 decodes blocks in sub-blocks: the smallest pairing that takes more than one. DiffusionGemma's
# blocks are its checkpoint's canvases.
# vanilla samples top-k and DiffusionGemma by its entropy bound: neither reads accept_threshold.
STRATEGY_SETTINGS = {"fast_dllm_v2": dict(block_size=8, sub_block_size=4, buffer_size=1),
                     "fast_dllm": dict(buffer_size=1), "vanilla": dict(buffer_size=1, accept_threshold=0.9),
                     "diffusion_gemma": dict(block_size=8, buffer_size=1, accept_threshold=0.9)}
PROMPTS = ["a shared prefix of sixteen and one", "the quick brown fox", "a shared prefix of sixteen and two", "ab"]
REQUESTS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=11),  # may end at EOS
    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=["a", "e"]),
]


def outputs(root: Path) -> dict[str, dict]:
    record = {}
    for family in AutoModelForDiffusionLM.keys():
        checkpoint = (write_random_diffusion_gemma_checkpoint(root / family) if family == "diffusion_gemma" else
                      write_random_checkpoint(root / family, family))
        for strategy in STRATEGIES.keys():
            key = f"{family}/{strategy}"
            try:
                engine = Diffulex(str(checkpoint), model_name=family, decoding_strategy=strategy,
                                  **{**SETTINGS, **STRATEGY_SETTINGS.get(strategy, {})})
            except ValueError as refusal:
                record[key] = {"refused": str(refusal).replace(str(checkpoint), "CHECKPOINT")}
                continue
            try:
                # A request the strategy refuses keeps its refusal; the others run together.
                refusals = {}
                for index, (prompt, params) in enumerate(zip(PROMPTS, REQUESTS)):
                    try:
                        engine.prepare_request(prompt, params)
                    except ValueError as refusal:
                        refusals[index] = {"refused": str(refusal)}
                accepted = [i for i in range(len(PROMPTS)) if i not in refusals]
                results = dict(zip(accepted, engine.generate([PROMPTS[i] for i in accepted],
                                                             [REQUESTS[i] for i in accepted]) if accepted else []))
            finally:
                engine.close()
            record[key] = {"requests": [refusals.get(i) or {
                "token_ids": results[i].token_ids, "text": results[i].text,
                "finish_reason": str(results[i].finish_reason), "nfe": results[i].nfe} for i in range(len(PROMPTS))]}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        record = outputs(Path(root))
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if args.record:
        RECORD.write_text(text)
    print(f"{len(record)} pairings, {sum('refused' in v for v in record.values())} refused")


if __name__ == "__main__":
    main()
