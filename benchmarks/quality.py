"""Decoding quality of the shipped demo models: does parallel decoding keep answers right while it takes
fewer forwards?

Every strategy setting decodes the same held-out addition problems (tools/demo_task.py) through the engine,
all of them submitted at once to `engine.generate`, and reports:
  accuracy         exact match: the text is the sum and the request stopped on EOS
  tokens/forward   (output tokens + the EOS that ends the answer) / forwards, over all requests
  NFE/request      forwards a request took part in, averaged
  wall             seconds to decode the whole set, engine construction excluded

    python benchmarks/quality.py                       # 500 problems, every setting; updates docs/quality.md
    python benchmarks/quality.py --num-problems 100 --no-doc --out results
    python benchmarks/quality.py --replot              # docs/quality.png again from docs/quality.json, no decoding

The table goes between the markers in docs/quality.md (unless --no-doc), the plot of accuracy against
tokens per forward to OUT/quality.png, and the raw numbers to OUT/quality.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from demo_task import BENCHMARK_SEED, GEN_LENGTH, PROMPT_WIDTH, Problem, held_out_problems  # noqa: E402
from diffulex_backend import Diffulex, FinishReason, SamplingParams  # noqa: E402

MODELS = {
    "demo-llada": REPO / "model_repository" / "diffulex" / "demo-llada",
    "demo-sdar": REPO / "checkpoints" / "demo-sdar",
}
BLOCK_SIZE = 4  # the SDAR demo's training block size; the generated area (GEN_LENGTH) is two blocks
THRESHOLDS = (0.7, 0.8, 0.9, 0.95)
RETENTION_RATIOS = (1.0, 0.9, 0.75, 0.5, 0.3)
BUFFERED = ("multi_bd", "dmax")  # strategies with several blocks in flight
DOC = REPO / "docs" / "quality.md"
TABLE_BEGIN, TABLE_END = "<!-- quality-table:begin -->", "<!-- quality-table:end -->"


@dataclass(frozen=True)
class Setting:
    model: str  # a key of MODELS
    strategy: str
    buffer_size: int = 1
    steps: int | None = None  # vanilla: denoising steps per block
    accept_threshold: float | None = None  # threshold strategies
    retention_ratio: float | None = None  # sparse attention: prompt pages kept, pages of one token each
    quantization: str | None = None  # "fp8": weights quantized at load (on a CPU, the float reference of the fp8 path)
    kv_cache_dtype: str = "auto"  # "fp8": the KV cache holds FP8 rows (on a CPU too: the reference's e4m3 rounding)

    @property
    def label(self) -> str:
        if self.steps is not None:
            label = f"steps={self.steps}"
        else:
            label = f"threshold={self.accept_threshold}" + (f" buffer={self.buffer_size}" if self.strategy in BUFFERED
                                                             else "")
        if self.retention_ratio is not None:
            label += f" retention={self.retention_ratio} (pages of 1 token)"
        if self.quantization is not None:
            label += f" {self.quantization} weights"
        if self.kv_cache_dtype != "auto":
            label += f" {self.kv_cache_dtype} KV cache"
        return label


def all_settings() -> list[Setting]:
    settings = [Setting("demo-llada", "vanilla", steps=BLOCK_SIZE), Setting("demo-llada", "vanilla", steps=BLOCK_SIZE // 4)]
    settings += [Setting("demo-llada", "fast_dllm", accept_threshold=t) for t in THRESHOLDS]
    for model in ("demo-sdar", "demo-llada"):
        settings += [Setting(model, "multi_bd", buffer_size=b, accept_threshold=t) for b in (1, 3) for t in THRESHOLDS]
    # DMax's soft inputs and editing at their defaults (token_merge_weight 1, edit_threshold 0.9). The demo models
    # were trained on hard tokens only, not on their own soft predictions as DMax's models are.
    for model in ("demo-sdar", "demo-llada"):
        settings += [Setting(model, "dmax", buffer_size=b, accept_threshold=t) for b in (1, 3) for t in THRESHOLDS]
    # Sparse attention by page retention, with pages of one token so that a ratio drops prompt tokens one by one.
    # The pages are chosen after the first forward, which prefills the prompt and decodes densely; one token per
    # step (steps = block_size) leaves all but the first token of an answer to the sparse steps.
    for model in ("demo-sdar", "demo-llada"):
        settings += [Setting(model, "multi_bd", steps=BLOCK_SIZE, retention_ratio=r) for r in RETENTION_RATIOS]
    # FP8 weights (W8A8, per-channel weight scales, per-token activation scales), beside their bf16 rows above.
    settings += [Setting("demo-llada", "vanilla", steps=BLOCK_SIZE, quantization="fp8")]
    settings += [Setting("demo-llada", "fast_dllm", accept_threshold=t, quantization="fp8") for t in (0.7, 0.9)]
    for model in ("demo-sdar", "demo-llada"):
        settings += [Setting(model, "multi_bd", buffer_size=b, accept_threshold=t, quantization="fp8")
                     for b in (1, 3) for t in (0.7, 0.9)]
    # An FP8 KV cache (each cached K/V row in e4m3 with its own scale), beside the same float rows.
    settings += [Setting("demo-llada", "vanilla", steps=BLOCK_SIZE, kv_cache_dtype="fp8")]
    settings += [Setting("demo-llada", "fast_dllm", accept_threshold=t, kv_cache_dtype="fp8") for t in (0.7, 0.9)]
    for model in ("demo-sdar", "demo-llada"):
        settings += [Setting(model, "multi_bd", buffer_size=b, accept_threshold=t, kv_cache_dtype="fp8")
                     for b in (1, 3) for t in (0.7, 0.9)]
    return settings


@dataclass
class Result:
    setting: Setting
    accuracy: float
    tokens_per_forward: float
    nfe_per_request: float
    wall_s: float
    num_problems: int


def run_setting(setting: Setting, problems: list[Problem], device: str, max_num_reqs: int) -> Result:
    max_model_len = PROMPT_WIDTH + GEN_LENGTH
    engine = Diffulex(
        str(MODELS[setting.model]), decoding_strategy=setting.strategy, block_size=BLOCK_SIZE,
        buffer_size=setting.buffer_size, max_model_len=max_model_len,
        page_size=BLOCK_SIZE if setting.retention_ratio is None else 1,
        **({} if setting.steps is None else {"sampling_mode": "topk"}),
        retention_ratio=1.0 if setting.retention_ratio is None else setting.retention_ratio,
        max_num_reqs=max_num_reqs, max_num_batched_tokens=max_num_reqs * max_model_len, device=device,
        quantization=setting.quantization, kv_cache_dtype=setting.kv_cache_dtype,
        **({} if setting.accept_threshold is None else {"accept_threshold": setting.accept_threshold}),
    )
    params = SamplingParams(max_tokens=GEN_LENGTH, steps=setting.steps)
    start = time.perf_counter()
    outputs = engine.generate([p.prompt for p in problems], params)
    wall = time.perf_counter() - start
    correct = sum(o.text == p.answer and o.finish_reason == FinishReason.STOP for o, p in zip(outputs, problems))
    decoded = sum(len(o.token_ids) + (o.finish_reason == FinishReason.STOP) for o in outputs)
    forwards = sum(o.nfe for o in outputs)
    return Result(setting, correct / len(problems), decoded / forwards, forwards / len(problems), wall, len(problems))


def markdown_table(results: list[Result]) -> str:
    lines = ["| model | strategy | setting | accuracy | tokens/forward | NFE/request | wall (s) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        s = r.setting
        lines.append(f"| {s.model} | {s.strategy} | {s.label} | {100 * r.accuracy:.1f}% | "
                     f"{r.tokens_per_forward:.2f} | {r.nfe_per_request:.2f} | {r.wall_s:.1f} |")
    return "\n".join(lines)


def environment(device: str, num_problems: int) -> str:
    return (f"{num_problems} held-out problems (seed {BENCHMARK_SEED}), block_size {BLOCK_SIZE}, max_tokens "
            f"{GEN_LENGTH}, greedy; device {device}, {torch.get_num_threads()} torch threads, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}.")


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.5, 5))
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(group_label(r.setting), []).append(r)
    # Points of different settings often coincide; decreasing sizes keep each one visible under the next.
    markers = "osD^vP*Xh<>"
    retention_sides: list[str] = []
    for k, (label, rs) in enumerate(groups.items()):
        ax.scatter([r.tokens_per_forward for r in rs], [100 * r.accuracy for r in rs], label=label,
                   marker=markers[k % len(markers)], s=max(140 - 12 * k, 20), alpha=0.8)
        # A retention group's points differ by their ratio alone: each one says which it is, the groups' marks on
        # either side of their points so that two models' marks at one spot stay apart.
        side = (6, -3) if len(retention_sides) % 2 == 0 else (-24, -3)
        for r in rs:
            if r.setting.retention_ratio is not None:
                ax.annotate(f"{r.setting.retention_ratio}", (r.tokens_per_forward, 100 * r.accuracy),
                            textcoords="offset points", xytext=side, fontsize=7)
        if any(r.setting.retention_ratio is not None for r in rs):
            retention_sides.append(label)
    lowest = min(100 * r.accuracy for r in results)
    ax.set_ylim(min(95.0, lowest - 3.0), 101.5)
    ax.set_xlim(0, BLOCK_SIZE)
    ax.set_xlabel(f"tokens per forward (at most block_size = {BLOCK_SIZE})")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title(f"Addition demo models, {results[0].num_problems} held-out problems")
    ax.grid(alpha=0.3)
    # Outside the axes: low-accuracy points sit in every corner of them.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def group_label(setting: Setting) -> str:
    """The plot's legend entry: one per model, strategy and buffer, and the retention runs apart from the dense."""
    label = f"{setting.model} {setting.strategy}" + (f" buffer={setting.buffer_size}" if setting.strategy in BUFFERED
                                                     else "")
    if setting.retention_ratio is not None:
        label += f" steps={setting.steps}, retention (ratio marked)"
    if setting.quantization is not None:
        label += f", {setting.quantization} weights"
    if setting.kv_cache_dtype != "auto":
        label += f", {setting.kv_cache_dtype} KV cache"
    return label


def load_results(path: Path) -> list[Result]:
    """The results a run wrote to quality.json."""
    results = []
    for raw in json.loads(path.read_text())["results"]:
        setting = Setting(**{k: v for k, v in raw["setting"].items() if k != "label"})
        results.append(Result(setting, **{k: v for k, v in raw.items() if k != "setting"}))
    return results


def update_doc(doc: Path, table: str, env: str) -> None:
    text = doc.read_text()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    doc.write_text(text[:begin] + "\n" + env + "\n\n" + table + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-problems", type=int, default=500)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-reqs", type=int, default=512, help="requests decoded in one batch")
    # The models are tiny: one thread is as fast as several, and immune to oversubscription on a busy host.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for quality.png and quality.json")
    parser.add_argument("--no-doc", action="store_true", help="do not update the table in docs/quality.md")
    parser.add_argument("--replot", action="store_true", help="only draw OUT/quality.png from OUT/quality.json")
    args = parser.parse_args(argv)
    if args.replot:
        plot(load_results(args.out / "quality.json"), args.out / "quality.png")
        return

    torch.set_num_threads(args.threads)
    problems = held_out_problems(args.num_problems, BENCHMARK_SEED)
    results = []
    for setting in all_settings():
        if setting.model not in args.models:
            continue
        results.append(run_setting(setting, problems, args.device, args.max_num_reqs))
        print(markdown_table(results[-1:]).splitlines()[-1], flush=True)
    table, env = markdown_table(results), environment(args.device, args.num_problems)
    print(env + "\n\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(
        {"environment": env, "results": [{**asdict(r), "setting": {**asdict(r.setting), "label": r.setting.label}}
                                         for r in results]}, indent=2) + "\n")
    plot(results, args.out / "quality.png")
    if not args.no_doc:
        update_doc(DOC, table, env)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
