"""LoRA adapters chosen per request against an adapter merged into the weights: the decode step at LLaDA-8B's shape
with rank-16 adapters on every attention and MLP projection.

Per batch (one 32-token block per request over a cached 512-token context), three cases:
  * unmerged, no adapter rows: adapters attached, no request uses one (the graphs without the delta);
  * unmerged, mixed: adapters attached, the batch's requests take 4 distinct adapters in turn (1 at batch 1), the
    delta computed per request by the segmented kernels inside the LoRA graphs;
  * merged: adapter 0 merged into the weights (pre_merge_lora), no adapter attached.
Each is timed as the forward alone (CUDA events around the runner's forward: a graph replay) and as the runner's
whole step (forward, sampler, acceptance, the step's one sync), with the ratios against merged and the floors:
weight streaming = the model's bytes / the measured HBM bandwidth, compute = 2 * params * tokens / the measured
bf16 matmul rate. Beside the mixed case, `delta_ms` is its LoRA work alone (`delta_ms` below), over the segment
table and bound its graph uses, in one CUDA graph (eager on the CPU). A check compares the logits of the unmerged
step with adapter 0 on every row against the merged step's. It writes lora.csv and lora.md to --out.

    PYTHONPATH=. python benchmarks/lora.py --out DIR            # GPU: LLaDA-8B, batch 1 and 32
    PYTHONPATH=. python benchmarks/lora.py --smoke --out DIR    # anywhere: a tiny model, one iteration each
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import pathlib
import statistics
import sys
import tempfile

import torch

from diffulex_backend.layers.lora import LoraSegments, device_segments, row_slots, segment_table  # noqa: E402
from diffulex_backend.lora import attach_adapters, has_adapters, load_adapter, lora_batch, merge_adapter  # noqa: E402
from diffulex_backend.lora import TARGETS as LORA_ATTRIBUTES  # noqa: E402
from diffulex_backend.scheduler import SchedulerOutput  # noqa: E402
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES, random_model, write_peft_adapter  # noqa: E402
from diffulex_kernels.activation import silu_and_mul  # noqa: E402
from diffulex_kernels.lora import add_lora_segments, shrink, silu_and_mul_lora  # noqa: E402
from forward import (BLOCK, FULL, PAGE_SIZE, SMOKE, SMOKE_SHAPE, cached_context_plans, device_ms, fill_cache,  # noqa: E402
                     floors, free_memory, graph_replay_ms, make_engine, measure_ceilings, wall_ms, write_model_dir)

LLADA_MODULES = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]
NUM_ADAPTERS = 4
FIELDS = ["model", "batch", "context", "tokens", "case", "distinct_adapters", "forward_ms", "step_ms", "delta_ms",
          "forward_vs_merged", "step_vs_merged", "weight_floor_ms", "compute_floor_ms", "forward_vs_weight_floor",
          "note"]


@dataclasses.dataclass(frozen=True)
class Settings:
    shape: dict
    name: str
    rank: int
    batches: tuple[int, ...]
    context: int
    reps: int


GPU = Settings(RELEASED_SHAPES["llada-8b"], "llada-8b", rank=16, batches=(1, 32), context=512, reps=20)
CPU_SMOKE = Settings(SMOKE_SHAPE, "smoke", rank=4, batches=(1, 2), context=32, reps=1)


def with_adapters(plans, slots: list[int]):
    """The plans with request i under adapter slots[i] (-1: none)."""
    for plan, slot in zip(plans, slots):
        plan.sampling = dataclasses.replace(plan.sampling, lora_index=slot)
    return plans


def time_case(engine, plans, reps: int) -> tuple[float, float]:
    """(forward ms on the device's clock, step ms on the host's) of one step over `plans`, medians."""
    runner, device = engine.runner, engine.device
    batch, lora = runner.build_batch(plans), lora_batch(plans)
    with torch.inference_mode():
        forward_ms = device_ms(lambda: runner.forward(batch, lora), device, reps)
        sched = SchedulerOutput(plans=plans)
        runner.execute(sched)  # its graph is captured by now; this warms the sampler at this batch
        step_ms = statistics.median(wall_ms(lambda: runner.execute(sched), device) for _ in range(reps))
    return forward_ms, step_ms


def graph_segments(engine, plans) -> LoraSegments:
    """The segment table and row bound the step's forward reads: its bucket's, where it replays a graph."""
    runner = engine.runner
    batch, lora = runner.build_batch(plans), lora_batch(plans)
    bucket = runner.padded_forward.bucket_for(batch, lora) if runner.padded_forward is not None else None
    if bucket is None:
        return device_segments(lora, engine.device)
    return LoraSegments(segment_table(lora, bucket.num_seqs).to(engine.device), bucket.max_seqlen_q)


def delta_ms(model, segments: LoraSegments, tokens: int, reps: int) -> float:
    """The LoRA work of every layer as the fused forward launches it, on random inputs: the qkv, o_proj and down_proj
    deltas, and gate_up's shrink with the SiLU-and-mul its expand is folded into, less the plain SiLU-and-mul that
    it replaces."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    work = []  # (stack, input, output) per projection and layer
    inputs = {}
    for layer in model.layers:
        for module, name, weight in ((layer.attn, "qkv_lora", layer.attn.qkv_proj.weight),
                                     (layer.attn, "o_lora", layer.attn.o_proj.weight),
                                     (layer.mlp, "gate_up_lora", layer.mlp.gate_up_proj.weight),
                                     (layer.mlp, "down_lora", layer.mlp.down_proj.weight)):
            stack = getattr(module, name)
            if stack is None:
                continue
            out_features, in_features = weight.shape
            if in_features not in inputs:
                inputs[in_features] = torch.randn(tokens, in_features, device=device, dtype=dtype)
            work.append((name, stack, inputs[in_features],
                         torch.randn(tokens, out_features, device=device, dtype=dtype)))
    slots = row_slots(segments.table, tokens)

    def chain():
        for name, stack, x, out in work:
            if name == "gate_up_lora":
                silu_and_mul_lora(out, shrink(x, stack.a, segments.table, segments.max_rows), stack.b, slots)
            else:
                add_lora_segments(out, x, stack.a, stack.b, segments.table, segments.max_rows)

    def plain_silu():
        for name, _, _, out in work:
            if name == "gate_up_lora":
                silu_and_mul(out)

    with torch.inference_mode():
        if device.type == "cuda":
            return graph_replay_ms(chain, device, reps) - graph_replay_ms(plain_silu, device, reps)
        return wall_ms(chain, device) - wall_ms(plain_silu, device)


def step_logits(engine, plans) -> torch.Tensor:  # [tokens, vocab] float32
    runner = engine.runner
    with torch.inference_mode():
        hidden = runner.forward(runner.build_batch(plans), lora_batch(plans))
        return engine.model.compute_logits(hidden).float()


def detach_adapters(model) -> None:
    for layer in model.layers:
        for owner, attribute in LORA_ATTRIBUTES.values():
            if hasattr(getattr(layer, owner), attribute):
                setattr(getattr(layer, owner), attribute, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one iteration of each case, any device")
    args = parser.parse_args(argv)
    command = "python benchmarks/lora.py " + " ".join(argv if argv is not None else sys.argv[1:])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = CPU_SMOKE if args.smoke else GPU
    if args.smoke:
        torch.set_num_threads(1)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(device, SMOKE if args.smoke else FULL)
    rows: list[dict] = []

    def report(**row) -> None:
        row = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        rows.append(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items() if v not in ("", None)), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(settings.shape, pathlib.Path(tmp) / "model")
        model = random_model(**settings.shape, dtype=dtype, device=device, seed=0)
        adapters = [load_adapter(write_peft_adapter(pathlib.Path(tmp) / f"adapter{i}", model_dir, LLADA_MODULES,
                                                    rank=settings.rank, seed=i + 1),
                                 model, f"adapter{i}", max_rank=settings.rank)
                    for i in range(NUM_ADAPTERS)]
        attach_adapters(model, adapters)
        assert has_adapters(model)
        largest = max(settings.batches)
        pages_per_request = -(-(settings.context + BLOCK) // PAGE_SIZE)
        engine = make_engine(model, model_dir, device, SMOKE if args.smoke else FULL,
                             max_model_len=settings.context + 2 * BLOCK, max_num_reqs=largest,
                             max_num_batched_tokens=max(4096, largest * BLOCK),
                             num_kv_pages=largest * pages_per_request)
        fill_cache(engine, seed=1)
        generator = torch.Generator().manual_seed(2)
        cases = {}  # (batch, case) -> (forward ms, step ms, distinct adapters)
        deltas = {}  # batch -> the mixed case's deltas alone, ms
        plans_by_batch = {b: cached_context_plans(engine, b, settings.context, generator) for b in settings.batches}
        for batch, plans in plans_by_batch.items():
            mixed = [i % NUM_ADAPTERS for i in range(batch)]
            for case, slots in (("unmerged, no adapter rows", [-1] * batch), ("unmerged, mixed", mixed)):
                times = time_case(engine, with_adapters(plans, slots), settings.reps)
                cases[batch, case] = (*times, len(set(slots) - {-1}))
            deltas[batch] = delta_ms(model, graph_segments(engine, plans), batch * BLOCK, settings.reps)
        check_batch = min(settings.batches)
        unmerged = step_logits(engine, with_adapters(plans_by_batch[check_batch], [0] * check_batch))
        # The merged model: adapter 0 in the weights (the graphs read the weights in place), none attached.
        merge_adapter(model, adapters[0])
        detach_adapters(model)
        merged = step_logits(engine, with_adapters(plans_by_batch[check_batch], [-1] * check_batch))
        check = float((unmerged - merged).norm() / merged.norm())
        for batch, plans in plans_by_batch.items():
            cases[batch, "merged"] = (*time_case(engine, with_adapters(plans, [-1] * batch), settings.reps), 0)
        graphs = engine.runner.padded_forward
        graph_note = ("LoRA graphs captured: " + str(sum(with_lora for _, with_lora in graphs.graphs))
                      if graphs is not None else "eager (no CUDA graphs on this device)")
        for batch in settings.batches:
            merged_forward, merged_step, _ = cases[batch, "merged"]
            f = floors(model, ceilings, batch, settings.context, batch * BLOCK)
            for case in ("merged", "unmerged, no adapter rows", "unmerged, mixed"):
                forward_ms, step_ms, distinct = cases[batch, case]
                report(model=settings.name, batch=batch, context=settings.context, tokens=batch * BLOCK, case=case,
                       distinct_adapters=distinct, forward_ms=forward_ms, step_ms=step_ms,
                       delta_ms=deltas[batch] if case == "unmerged, mixed" else "",
                       forward_vs_merged=forward_ms / merged_forward, step_vs_merged=step_ms / merged_step,
                       weight_floor_ms=f["weight_floor_ms"], compute_floor_ms=f["compute_floor_ms"],
                       forward_vs_weight_floor=forward_ms / f["weight_floor_ms"],
                       note=graph_note if case == "unmerged, mixed" else "")
        del engine, model
        free_memory(device)

    with open(args.out / "lora.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"`{command}`", "",
             f"HBM copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s (read + write); "
             f"bf16 matmul {ceilings.matmul_rate / 1e12:.0f} TFLOP/s; rank {settings.rank} on "
             f"{', '.join(LLADA_MODULES)}", "",
             f"Check: logits of the unmerged step with adapter 0 on every row against the merged step, batch "
             f"{check_batch}: relative error {check:.2e}", "",
             "| " + " | ".join(FIELDS) + " |", "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in FIELDS) + " |" for r in rows]
    (args.out / "lora.md").write_text("\n".join(lines) + "\n")
    print(f"check: unmerged (adapter 0 everywhere) vs merged logits, relative error {check:.2e}")
    print(f"wrote {args.out / 'lora.csv'} and {args.out / 'lora.md'}", flush=True)
    # In float32 the two differ by roundings only; in bf16 merging rounds W + scale·B·A to 8 bits of mantissa, which
    # 32 random layers amplify, so the figure is reported, not judged.
    if dtype == torch.float32 and check > 1e-4:
        sys.exit(f"unmerged and merged logits disagree: relative error {check:.2e}")


if __name__ == "__main__":
    main()
