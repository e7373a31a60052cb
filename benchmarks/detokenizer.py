"""Host time the detokenizer takes per step: each request's committed block turned into text, at batch 64 with
2048-token outputs, decoded incrementally (the engine's Detokenizer) against the whole sequence again at every
block (how it decoded before), in one run, with the same token streams.

The tokenizer is a real byte-level BPE, trained here on the Python standard library's source (offline), with a
vocabulary of 32k: the test checkpoints' byte tokenizer, one token per byte, would hide what a merge table costs.
The token streams are that source, encoded: real text, in blocks of `block` tokens.

    python benchmarks/detokenizer.py --out DIR            # batch 64, 2048 tokens, blocks of 32
    python benchmarks/detokenizer.py --out DIR --smoke    # a small tokenizer and a few short streams
"""
from __future__ import annotations

import argparse
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from diffulex_backend.output import Detokenizer


class WholeSequenceDetokenizer(Detokenizer):
    """The same detokenizer, decoding every token again at each block."""

    def _text(self) -> str:
        return self._decode(len(self.ids))


@dataclass(frozen=True)
class Plan:
    batch: int
    tokens: int
    block: int
    vocab: int
    corpus_bytes: int


FULL = Plan(batch=64, tokens=2048, block=32, vocab=32000, corpus_bytes=16 << 20)
SMOKE = Plan(batch=4, tokens=256, block=32, vocab=2000, corpus_bytes=1 << 20)


def corpus(limit: int) -> list[str]:
    """Source files of the standard library, up to `limit` bytes."""
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(errors="replace")
        texts.append(text)
        size += len(text)
        if size >= limit:
            break
    return texts


def train_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def streams(tokenizer, texts: list[str], plan: Plan) -> list[list[int]]:
    ids = tokenizer("".join(texts[-200:]))["input_ids"]  # the files the tokenizer trained on last
    need = plan.batch * plan.tokens
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[i * plan.tokens:(i + 1) * plan.tokens] for i in range(plan.batch)]


def run(cls, tokenizer, token_streams: list[list[int]], plan: Plan) -> tuple[list[float], list[str]]:
    """Seconds of each step (every request's block), and each request's text."""
    detokenizers = [cls(tokenizer, stop=[]) for _ in token_streams]
    texts = [""] * len(token_streams)
    step_seconds = []
    for start in range(0, plan.tokens, plan.block):
        final = start + plan.block >= plan.tokens
        began = time.perf_counter()
        for i, (detokenizer, ids) in enumerate(zip(detokenizers, token_streams)):
            texts[i] += detokenizer.add(ids[start:start + plan.block], final)[0]
        step_seconds.append(time.perf_counter() - began)
    return step_seconds, texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    texts = corpus(plan.corpus_bytes)
    tokenizer = train_tokenizer(texts, plan.vocab)
    token_streams = streams(tokenizer, texts, plan)
    rows, outputs = [], {}
    for name, cls in (("whole sequence at every block (before)", WholeSequenceDetokenizer),
                      ("incremental (now)", Detokenizer)):
        seconds, outputs[name] = run(cls, tokenizer, token_streams, plan)
        rows.append((name, sum(seconds) / len(seconds), seconds[0], seconds[-1]))
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in token_streams]
    equal = all(texts == expected for texts in outputs.values())
    before, now = rows[0][1], rows[1][1]
    lines = [
        "# Detokenizer host time per step", "",
        f"Batch {plan.batch}, {plan.tokens}-token outputs committed in blocks of {plan.block} "
        f"({plan.tokens // plan.block} steps); byte-level BPE of {len(tokenizer)} tokens trained on "
        f"{sum(map(len, texts)) / 2**20:.1f} MiB of Python source. Texts equal to decoding each whole output: "
        f"{equal}.", "",
        "| detokenizer | mean ms per step | first step ms | last step ms |", "|---|---:|---:|---:|",
        *[f"| {name} | {mean * 1e3:.2f} | {first * 1e3:.2f} | {last * 1e3:.2f} |" for name, mean, first, last in rows],
        "", f"Incremental decoding takes {now / before:.3f}x the host time per step of decoding whole sequences.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "detokenizer.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if not equal:
        raise SystemExit("the detokenizers' texts differ from decoding each whole output")


if __name__ == "__main__":
    main()
