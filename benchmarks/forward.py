"""The engine's forward and decode step against the GPU's physical floors, and against plain PyTorch.

One run measures, and prints as it goes:
  * the two ceilings: HBM bandwidth (a large device copy, bytes read plus written) and the bf16 matmul rate;
  * per model shape (random bf16 weights built on the GPU) and per case (batch, context), with one 32-token
    block per request:
      - the floors: weight streaming = the bytes of the weights the forward reads / bandwidth; compute =
        2 * active params * tokens / rate; and, beside them, those weights plus the cached K/V the attention
        reads, over bandwidth. For a dense model the weights read are all of them and every parameter is
        active. For a mixture-of-experts model (LLaDA2, SDAR-MoE) the weights read are everything but the routed
        experts plus the routed experts the forward's tokens actually reach: each MoE layer's router is recorded
        during one eager forward over the same inputs and its distinct experts counted (`experts_touched`, the
        mean over MoE layers; `experts_touched_uniform` beside it is what uniform routing would reach); the
        active params are the non-expert ones plus K routed and the shared experts per token;
      - the engine's forward (graph replay and the block's logits) and its runner step (forward, sampler,
        acceptance, the one sync), and the step's time outside the forward (the step's wall time less the
        forward's device time: what sampling, acceptance, the sync and the host add);
      - plain PyTorch (plain_pytorch.py) over the same weights: eager, and captured in one CUDA graph. It
        implements the plain dense block only, so it is not run for models with experts, q/k norms or partial
        rotary, and their rows say so;
  * end-to-end decode steps with k = 1, 2, 4 tokens accepted per block per forward (the engine's top-k
    schedule, so random weights cannot change how much each step decodes): ms per step and tokens/s, for the
    engine and for the plain loop;
  * the engine at the settings of Diffulex's own benchmark (multi_bd buffer 1, d2f buffer 4, fast_dllm_v2 with
    its default sub-blocks of 8, and dmax with its default soft input and editing; batch 1 and 32; 256-token
    prompt, 256 new tokens, block 32, greedy): ms per step, so each strategy's step reads against multi_bd's from
    the same run. Only the engine is measured: a comparison with Diffulex holds only from one run that measures
    both on one machine;
  * a check: the engine's logits and greedy output with kernels and graphs against its torch path.
With --quantization none,fp8 every section runs twice per model, in one process: over the bf16 weights, then over
the same weights quantized to fp8 at load's rule (`quantization: fp8`, quantization.py), as MODEL-fp8. Its floors
count the weights as they are held (fp8 projections at one byte with their scales, the embedding and output head
in bf16) and its compute floor takes the fp8 matmul rate (cuBLASLt, a square product) measured at the start.
Check rows hold it to the float weights over one forward's inputs and cache: `fp8_layer_N`, each layer fed the float
forward's input, against the float layer's update (FP8_LAYER_BOUND); `fp8_output_layers_fed`, the logits of that
forward (FP8_OUTPUT_BOUND); `fp8_vs_float_weights`, the engine's whole forward, each layer's difference compounded.
It writes forward.csv, forward.md and a plot per model (time versus batch against the two floors) to --out.

    python benchmarks/forward.py --out DIR                     # GPU: LLaDA-8B
    python benchmarks/forward.py --out DIR --models llada-8b,dream-7b
    python benchmarks/forward.py --out DIR --models llada2-mini --sections forward,decode,profile
    python benchmarks/forward.py --out DIR --sections forward,diffulex --quantization none,fp8 --batches 1,32
    python benchmarks/forward.py --smoke --out DIR             # anywhere: tiny dense and MoE shapes, one iteration each
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import csv
import gc
import json
import math
import pathlib
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

from diffulex_backend import SamplingParams  # noqa: E402
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES, random_config, random_model, write_byte_tokenizer  # noqa: E402
from diffulex_backend.testing.diffusion_gemma_checkpoint import (RELEASED_26B_A4B, TINY, TINY_SCHEDULE,  # noqa: E402
                                                                 random_diffusion_gemma, tiny_config,
                                                                 write_config_files)
from diffulex_backend.models.diffusion_gemma import DenoiseSchedule, GemmaMoE  # noqa: E402
from diffulex_backend.cuda_graph import PaddedForward  # noqa: E402
from diffulex_backend.engine import DiffulexEngine  # noqa: E402
from diffulex_backend.model_setup import attention_backend_name, select_attention  # noqa: E402
from diffulex_backend.layers import fused_forward, moe as moe_layer  # noqa: E402
from diffulex_backend.layers.moe import MoE, experts_reference  # noqa: E402
from diffulex_backend.plan import SeqPlan  # noqa: E402
from diffulex_backend.profiling import activities_for, device_profile  # noqa: E402
from diffulex_backend.quantization import has_fp8, quantize_model  # noqa: E402
from diffulex_backend.layers.fp8_linear import Fp8Linear, quantize_weight  # noqa: E402
from diffulex_backend.runner import kv_cache_layout  # noqa: E402
from diffulex_backend.scheduler import SchedulerOutput  # noqa: E402
from diffulex_backend.upload import upload  # noqa: E402
from diffulex_kernels.kv_store import SCALE_BYTES, pack_fp8_rows  # noqa: E402
from diffulex_kernels.fp8 import quantize_rows  # noqa: E402
from diffulex_kernels.linear import linear  # noqa: E402
from diffulex_kernels.moe import fused_moe  # noqa: E402
from plain_pytorch import PlainDecoder  # noqa: E402

BLOCK = 32
PAGE_SIZE = 32
FIELDS = ["section", "model", "case", "batch", "context", "k", "tokens", "engine_ms", "engine_step_ms",
          "step_outside_forward_ms", "plain_ms",
          "plain_graph_ms", "weight_floor_ms", "compute_floor_ms", "memory_floor_ms", "engine_vs_weight_floor",
          "engine_vs_compute_floor", "engine_vs_plain", "engine_tokens_per_s", "plain_tokens_per_s",
          "experts_touched", "experts_touched_uniform", "weight_floor_uniform_ms", "error", "bound", "within", "note"]


@dataclass(frozen=True)
class Plan:
    """What one run covers; --smoke shrinks everything to a tiny model on any device."""
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_context: int
    tokens_per_step: tuple[int, ...]
    diffulex_batches: tuple[int, ...]
    diffulex_prompt: int
    diffulex_new_tokens: int
    reps: int
    smoke: bool
    kv_cache_dtype: str = "auto"  # the engine's cache: the model's dtype, or "fp8" rows
    attention_backend: str = "auto"  # the engine's attention_backend, but for the torch paths' rows


FULL = Plan(batches=(1, 8, 32, 64), contexts=(512, 2048), decode_batches=(1, 8, 32, 64), decode_context=512,
            tokens_per_step=(1, 2, 4), diffulex_batches=(1, 32), diffulex_prompt=256, diffulex_new_tokens=256,
            reps=10, smoke=False)
SMOKE = Plan(batches=(1, 2), contexts=(64,), decode_batches=(2,), decode_context=32, tokens_per_step=(1, 4),
             diffulex_batches=(1, 2), diffulex_prompt=16, diffulex_new_tokens=32, reps=1, smoke=True)
SMOKE_SHAPE = dict(model_name="llada", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                   intermediate_size=128, vocab_size=300, max_position_embeddings=4096)
# LLaDA2's routing in miniature (a dense first layer, groups, a shared expert), with enough experts that a block
# reaches only some of them: its weight floor must come out under the all-experts one.
SMOKE_MOE_SHAPE = dict(model_name="llada2", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=300, max_position_embeddings=4096, qk_norm=True,
                       partial_rotary_factor=0.5, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=32,
                       num_shared_experts=1, dense_layers=(0,), num_expert_groups=8, topk_groups=4,
                       routed_scaling_factor=2.5)

# DiffusionGemma's shapes are text_config keys (diffusion_gemma_checkpoint.py), not ModelArch's: its canvases of
# random tokens run in the canvas section only, and the other sections' 32-token blocks of masks do not apply.
CANVAS_SHAPES = {"diffusion_gemma-26b-a4b": dict(model_name="diffusion_gemma", **RELEASED_26B_A4B)}
SMOKE_CANVAS_SHAPE = dict(model_name="diffusion_gemma", **TINY)
SMOKE_MODELS = {"smoke": SMOKE_SHAPE, "smoke-moe": SMOKE_MOE_SHAPE, "smoke-gemma": SMOKE_CANVAS_SHAPE}
CANVAS_SECTIONS = ("canvas", "canvas_profile")  # the sections a canvas model runs


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s, read + written
    matmul_rate: float  # flop/s, in the engines' dtype: bf16 on a GPU, float32 on a CPU
    fp8_matmul_rate: float | None = None  # flop/s, cuBLASLt fp8; measured when the run quantizes

    def rate_for(self, model) -> float:
        """The matmul rate of a model's products: fp8's for an FP8 model (the float rate on a CPU, where fp8 is the
        float32 reference). An FP8 MoE model's experts multiply in bf16 (weight-only) and its output head stays in
        bf16, so for it this floor is a lower bound below what its kernels can reach."""
        return self.fp8_matmul_rate if has_fp8(model) and self.fp8_matmul_rate else self.matmul_rate


class Report:
    """Rows to the CSV as they come (a run cut short keeps what it measured), and a line each to stdout."""

    def __init__(self, out: pathlib.Path):
        self.out = out
        self.rows: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "forward.csv", "w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()

    def add(self, **row) -> None:
        row = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        self.rows.append(row)
        with open(self.out / "forward.csv", "a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items() if v not in ("", None)), flush=True)


# ---- timing ------------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median time of fn on the device's stream (CUDA events), host gaps between its launches included."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(wall_ms(fn, device))
    return statistics.median(times)


def wall_ms(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def measure_ceilings(device: torch.device, plan: Plan, fp8: bool = False) -> Ceilings:
    n = 1 << (16 if plan.smoke else 30)  # 2 GiB of bf16
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    m = 256 if plan.smoke else 8192
    # The product in the dtype the engines run in: bf16 on a GPU, float32 on a CPU, where a CPU without bf16
    # instructions multiplies bf16 many times slower than the float32 forward it would be the floor of.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(m, m, device=device).to(dtype) for _ in range(2))
    # An idle GPU starts at low clocks: a few calls are not enough warm-up (one run measured 633 TFLOP/s
    # after two, where the same kind of card gives about 790), so keep it busy for a while first.
    warm_until = time.perf_counter() + (0 if plan.smoke else 2.0)
    while time.perf_counter() < warm_until:
        a @ b
        synchronize(device)
    copy_ms = device_ms(lambda: dst.copy_(src), device, reps=max(plan.reps, 3) * 2)
    matmul_ms = device_ms(lambda: a @ b, device, reps=max(plan.reps, 3) * 2)
    ceilings = Ceilings(bandwidth=2 * 2 * n / (copy_ms * 1e-3), matmul_rate=2 * m**3 / (matmul_ms * 1e-3))
    if fp8 and device.type == "cuda":
        ceilings.fp8_matmul_rate = fp8_matmul_rate(a, b, device, reps=max(plan.reps, 3) * 2)
    return ceilings


def fp8_matmul_rate(a: torch.Tensor, b: torch.Tensor, device: torch.device, reps: int) -> float:
    """flop/s of cuBLASLt's fp8 product (`torch._scaled_mm`, unit row-wise scales) of the square a @ b, each
    quantized to fp8 first."""
    (aq, _), (bq, _) = quantize_weight(a), quantize_weight(b)
    m = a.shape[0]
    rows, columns = torch.ones(m, 1, device=device), torch.ones(1, m, device=device)
    fp8_ms = device_ms(lambda: torch._scaled_mm(aq, bq.t(), scale_a=rows, scale_b=columns, out_dtype=torch.bfloat16),
                       device, reps=reps)
    return 2 * m**3 / (fp8_ms * 1e-3)


# ---- the engine around a random-weight model ---------------------------------------------------------------

class RandomWeightEngine(DiffulexEngine):
    """The engine over a model built in memory (random weights at a released shape); `model_dir` holds only its
    config.json and tokenizer."""

    def __init__(self, model, model_dir: str, **kwargs):
        self.prebuilt = model
        super().__init__(model_dir, **kwargs)

    def _load_model(self, tp):
        select_attention(self.prebuilt, self.config.attention_backend, self.device, self.dtype)
        return self.prebuilt, {}


def write_model_dir(shape: dict, directory: pathlib.Path) -> str:
    """config.json and the byte tokenizer for a random model of this shape; no weights."""
    directory.mkdir(parents=True, exist_ok=True)
    config = random_config(**shape)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(directory, shape["max_position_embeddings"])
    return str(directory)


def is_canvas_model(shape: dict) -> bool:
    return shape["model_name"] == "diffusion_gemma"


def build_model(shape: dict, directory: pathlib.Path, dtype: torch.dtype, device: torch.device, smoke: bool):
    """(the random model of this shape, built on `device`, and its directory: config files, no weights)."""
    if not is_canvas_model(shape):
        return random_model(**shape, dtype=dtype, device=device, seed=0), write_model_dir(shape, directory)
    text = {k: v for k, v in shape.items() if k != "model_name"}
    config = tiny_config(**text)
    # The released sampler's settings (transformers' defaults); the tiny model's shorter schedule for a smoke run.
    write_config_files(directory, config, TINY_SCHEDULE if smoke else DenoiseSchedule())
    return random_diffusion_gemma(config, directory, dtype=dtype, device=device), str(directory)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def page_bytes(model, kv_cache_dtype: str = "auto") -> int:
    """A KV page's bytes over every layer, laid out as the engine lays it out."""
    shape, dtype = kv_cache_layout(model, 1, PAGE_SIZE, model.embed_tokens.weight.dtype, kv_cache_dtype)
    return math.prod(shape) * dtype.itemsize


def pool_pages(model, device: torch.device, wanted: int, reserve_bytes: float, kv_cache_dtype: str = "auto"
               ) -> int:
    """`wanted` pages, or as many as fit in free memory less `reserve_bytes`."""
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(wanted, int((free - reserve_bytes) // page_bytes(model, kv_cache_dtype))))


def long_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every long-prompt benchmark (prefill.py, retention.py) takes: where, which model, how long a
    prompt, which batches."""
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--model", default="llada-8b", choices=sorted(RELEASED_SHAPES))
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--batches", default="1,8")


def long_prompt_setup(model: str, smoke: bool, prompt: int) -> tuple[torch.device, Plan, dict, str, torch.dtype]:
    """(device, plan, shape, name, dtype) of a benchmark of long prompts over a random model of a released shape (a
    tiny one on one thread with `smoke`), its context limit raised to the prompt and two blocks: random weights at
    a context past the released model's (LLaDA-8B's is 4096) cost what they would cost."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if smoke:
        torch.set_num_threads(1)
    shape = dict(SMOKE_SHAPE if smoke else RELEASED_SHAPES[model])
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], prompt + 2 * BLOCK)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return device, SMOKE if smoke else FULL, shape, "smoke" if smoke else model, dtype


def make_engine(model, model_dir: str, device: torch.device, plan: Plan, **kwargs) -> RandomWeightEngine:
    settings = dict(block_size=BLOCK, page_size=PAGE_SIZE, enable_prefix_caching=False, device=str(device),
                    dtype="float32" if device.type == "cpu" else "bfloat16", kv_cache_dtype=plan.kv_cache_dtype,
                    attention_backend=plan.attention_backend)
    settings.update(kwargs)
    return RandomWeightEngine(model, model_dir, **settings)


def random_prompt(length: int, vocab: int, generator: torch.Generator, low: int = 0) -> list[int]:
    return torch.randint(low, min(vocab, 256), (length,), generator=generator).tolist()  # byte tokens


def cached_context_plans(engine, batch: int, context: int, generator: torch.Generator) -> list[SeqPlan]:
    """`batch` requests whose `context` prompt tokens are already in the cache, each feeding one block.

    When the pool is smaller than batch x context, page tables wrap around it: the attention still reads
    every cached token from HBM, since a layer's share of the pool is far larger than the L2 cache."""
    config, arch = engine.config, engine.model.arch
    pages_per_request = -(-(context + BLOCK) // PAGE_SIZE)
    pool = engine.kv_cache.num_pages
    plans = []
    for i in range(batch):
        resolved = engine.prepare_request(random_prompt(context, arch.vocab_size, generator),
                                          SamplingParams(max_tokens=BLOCK, ignore_eos=True, seed=i))
        req = engine.req_cls(f"bench-{i}", resolved, config, config.mask_token_id, arch.shifted)
        req.num_cached = context
        req.page_table = [(i * pages_per_request + p) % pool for p in range(pages_per_request)]
        if arch.shifted:  # the hidden state of the last prompt token predicts the block's first token
            hidden = torch.randn(arch.hidden_size, generator=generator).to(engine.device, engine.dtype)
            engine.runner.carry_hidden[req.request_id] = hidden
        plans.append(req.plan(config.max_num_batched_tokens))
    return plans


def fill_cache(engine, seed: int) -> None:
    """Random K/V in the pool, the same values for the same seed whatever the pool's dtype (drawn in bf16; a pool of
    FP8 rows holds them quantized, as the store writes them): never time or compare on zeros."""
    cache = engine.runner.kv_cache
    generator = torch.Generator(cache.device).manual_seed(seed)
    for slab in cache.flatten(0, 1):  # a layer's K or V at a time: no float32 copy of the whole pool
        if cache.dtype == torch.uint8:
            rows = torch.randn((*slab.shape[:-1], slab.shape[-1] - SCALE_BYTES), generator=generator,
                               device=cache.device, dtype=torch.bfloat16)
            pack_fp8_rows(rows, out=slab)
        else:
            slab.copy_(torch.randn(slab.shape, generator=generator, device=cache.device, dtype=torch.bfloat16))


def engine_logits(engine, plans: list[SeqPlan]) -> torch.Tensor:  # [B * BLOCK, vocab]
    runner = engine.runner
    batch = engine.runner.build_batch(plans)
    rows, carry = runner.logit_rows(plans)
    with torch.inference_mode():
        hidden = runner.forward(batch)
        if carry:
            hidden = torch.cat([hidden, torch.stack(carry)])
        # Through pinned memory, as the runner uploads them: a pageable copy would hold the host until the
        # forward ends, and the LM head's launch would then leave the GPU idle.
        return engine.model.compute_logits(hidden[upload([rows], engine.device)[0]])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|: how far `a` is from the reference `b`."""
    return float((a - b).norm() / b.norm())


# ---- sections ------------------------------------------------------------------------------------------------

def floors(model, ceilings: Ceilings, batch: int, context: int, tokens: int,
           experts_touched: float | None = None, kv_cache_dtype: str = "auto") -> dict:
    """The floors of one forward of `tokens` tokens (batch requests over `context` cached tokens each).

    Weight floor: the bytes of the weights the forward reads, over the bandwidth. A dense model reads them all.
    A MoE model reads everything but the routed experts, and of those only the experts its tokens reach:
    `experts_touched` per MoE layer (the mean over layers), as measured on this forward (`routed_experts`);
    without it, the number uniform routing would reach (ModelArch.expected_touched_experts).
    Memory floor: those weights and the cached K/V the attention reads, as the cache holds them (kv_cache_dtype).
    Compute floor: 2 * active params * tokens, where a token's active params are all but the routed experts
    it does not take (equal to all params for a dense model), at the rate of the model's products.
    An FP8 model's bytes are those it holds: each parameter at its own dtype, the scales included."""
    arch = model.arch
    uniform = arch.expected_touched_experts(tokens)
    if experts_touched is None:
        experts_touched = uniform
    model_bytes, expert_bytes = held_bytes(model)
    bytes_per_expert = expert_bytes / arch.num_moe_layers / arch.num_experts if arch.num_experts else 0.0

    def weight_bytes_with(touched: float) -> float:
        return model_bytes - expert_bytes + arch.num_moe_layers * touched * bytes_per_expert

    weight_bytes = weight_bytes_with(experts_touched)
    kv_bytes = batch * context * page_bytes(model, kv_cache_dtype) / PAGE_SIZE
    result = dict(weight_floor_ms=1e3 * weight_bytes / ceilings.bandwidth,
                  compute_floor_ms=1e3 * 2 * arch.num_active_params() * tokens / ceilings.rate_for(model),
                  memory_floor_ms=1e3 * (weight_bytes + kv_bytes) / ceilings.bandwidth)
    if arch.num_experts:  # beside it, the weight floor if the tokens were routed uniformly
        result["weight_floor_uniform_ms"] = 1e3 * weight_bytes_with(uniform) / ceilings.bandwidth
    return result


def held_bytes(model) -> tuple[int, int]:
    """(the bytes of every parameter as the model holds it, the routed experts' share of them): a float model's
    num_params * itemsize; an FP8 one's projections at one byte a weight, plus their scales."""
    total = experts = 0
    for module in model.modules():
        routed = isinstance(module, (MoE, GemmaMoE))
        for name, param in module.named_parameters(recurse=False):
            size = param.numel() * param.element_size()
            total += size
            if routed and name.startswith(("w_gate_up", "w_down", "gate_up_proj", "down_proj")):
                experts += size
    return total, experts


def expert_columns(model, tokens: int, routes: list | None) -> dict:
    """The CSV's expert counts: measured (mean distinct experts per MoE layer) and under uniform routing."""
    if not model.arch.num_experts:
        return {}
    return dict(experts_touched=touched_per_layer(routes, model.arch.num_experts) if routes else "",
                experts_touched_uniform=model.arch.expected_touched_experts(tokens))


class RecordRouting:
    """Within the block, the experts each MoE layer's router picks: every call of `select_experts`, the routing
    MoE.forward uses, appends its (topk_ids, topk_weights), so one eager forward gives one entry per MoE layer in
    layer order. Only for eager forwards: a CUDA-graph replay runs no Python."""

    def __init__(self):
        self.routes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self):
        self.original = moe_layer.select_experts

        def recording(*args, **kwargs):
            ids, weights = self.original(*args, **kwargs)
            self.routes.append((ids, weights))
            return ids, weights

        moe_layer.select_experts = recording
        return self

    def __exit__(self, *exc):
        moe_layer.select_experts = self.original


def routed_experts(engine, plans: list[SeqPlan]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The routing of the engine's forward over `plans`, one (topk_ids, topk_weights) per MoE layer, from one eager
    forward over the same inputs; None for a dense model."""
    model = engine.model
    if not model.arch.num_experts:
        return None
    with torch.inference_mode(), RecordRouting() as record:
        input_ids, positions, meta = engine.runner.build_batch(plans).to_device(engine.device)
        model(input_ids, positions, meta, engine.runner.kv_cache)
    if len(record.routes) != model.arch.num_moe_layers:
        raise RuntimeError(f"recorded {len(record.routes)} routings for {model.arch.num_moe_layers} MoE layers")
    return record.routes


def touched(routes: list | None, model) -> float | None:
    """touched_per_layer of a MoE model's routes; None without them (a dense model)."""
    return touched_per_layer(routes, model.arch.num_experts) if routes else None


def touched_per_layer(routes: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int) -> float:
    """The mean distinct routed experts a MoE layer reaches. A shared expert run among the routed ones (ids from
    num_experts on, every token's) is dense weight, which the floor counts with the model's other weights."""
    return statistics.mean(int(ids[ids < num_experts].unique().numel()) for ids, _ in routes)


def plain_supported(model) -> bool:
    """plain_pytorch.py writes out the plain dense block over float weights: full rotary, no q/k norm, a dense MLP
    in every layer."""
    arch = model.arch
    return not arch.num_experts and not arch.qk_norm and arch.partial_rotary_factor == 1 and not has_fp8(model)


PLAIN_SKIPPED = ("plain PyTorch not run: plain_pytorch.py implements the dense block over float weights only (no "
                 "experts, q/k norm, partial rotary or fp8)")


def plain_inputs(model, batch: int, context: int, generator: torch.Generator, device: torch.device):
    arch = model.arch
    block = torch.randint(0, min(arch.vocab_size, 256), (batch, BLOCK), generator=generator).to(device)
    positions = torch.arange(context, context + BLOCK, device=device)
    past = [torch.randn(batch, arch.num_kv_heads, context, arch.head_dim, device=device,
                        dtype=model.embed_tokens.weight.dtype) for _ in range(2)]
    return block, positions, past


def graph_replay_ms(fn, device: torch.device, reps: int) -> float:
    """fn captured in one CUDA graph, timed by its replays (plain PyTorch at its best: no launch overhead)."""
    if device.type != "cuda":
        return math.nan
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return device_ms(graph.replay, device, reps)


def forward_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    generator = torch.Generator().manual_seed(0)
    largest = max(plan.batches) * -(-(max(plan.contexts) + BLOCK) // PAGE_SIZE)
    with_plain = plain_supported(model)
    # Leave room for plain PyTorch's largest case: its cache, the concatenated copy and the logits.
    pages = pool_pages(model, device, largest, reserve_bytes=16e9 if with_plain else 8e9,
                       kv_cache_dtype=plan.kv_cache_dtype)
    engine = make_engine(model, model_dir, device, plan, max_model_len=max(plan.contexts) + 2 * BLOCK,
                         max_num_reqs=max(plan.batches), max_num_batched_tokens=max(4096, max(plan.batches) * BLOCK),
                         num_kv_pages=pages)
    fill_cache(engine, seed=1)
    plain = PlainDecoder(model) if with_plain else None
    for context in plan.contexts:
        for batch in plan.batches:
            tokens = batch * BLOCK
            plans = cached_context_plans(engine, batch, context, generator)
            routes = routed_experts(engine, plans)
            forward_ms = device_ms(lambda: engine_logits(engine, plans), device, plan.reps)
            sched = SchedulerOutput(plans=plans)
            step_ms = statistics.median(wall_ms(lambda: engine.runner.execute(sched), device)
                                        for _ in range(plan.reps + 1))
            note = f"{attention_backend_name(engine.model)} attention; pool {pages} pages" + (
                " (page tables wrap)" if pages < len(plans) * len(
                plans[0].page_table) else "")
            plain_columns = {}
            if with_plain:
                block, positions, (past_k, past_v) = plain_inputs(model, batch, context, generator, device)

                def plain_forward():
                    return plain.forward(block, positions, past_k, past_v)

                with torch.inference_mode():
                    plain_ms = device_ms(plain_forward, device, max(1, plan.reps // 2))
                    graph_ms = graph_replay_ms(plain_forward, device, plan.reps)
                del block, past_k, past_v
                plain_columns = dict(plain_ms=plain_ms, plain_graph_ms=graph_ms, engine_vs_plain=forward_ms / plain_ms)
            else:
                note += "; " + PLAIN_SKIPPED
            free_memory(device)
            f = floors(model, ceilings, batch, context, tokens, touched(routes, model),
                       plan.kv_cache_dtype)
            report.add(section="forward", model=name, case=f"b{batch}_ctx{context}", batch=batch, context=context,
                       tokens=tokens, engine_ms=forward_ms, engine_step_ms=step_ms,
                       step_outside_forward_ms=step_ms - forward_ms, **plain_columns, **f,
                       engine_vs_weight_floor=forward_ms / f["weight_floor_ms"],
                       engine_vs_compute_floor=forward_ms / f["compute_floor_ms"],
                       **expert_columns(model, tokens, routes), note=note)
    del engine
    free_memory(device)


def decode_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    """Steady decode with exactly k tokens accepted per block per forward (top-k schedule, steps = 32 / k)."""
    generator = torch.Generator().manual_seed(1)
    plain = PlainDecoder(model) if plain_supported(model) else None
    context = plan.decode_context
    for batch in plan.decode_batches:
        max_tokens = BLOCK * (4 if plan.smoke else 5)
        pages = batch * -(-(context + max_tokens) // PAGE_SIZE)
        # Every prompt prefills in the first forward, so the requests decode in step: each commit is one step.
        engine = make_engine(model, model_dir, device, plan, sampling_mode="topk", max_model_len=context + max_tokens,
                             max_num_reqs=batch, max_num_batched_tokens=batch * (context + BLOCK), num_kv_pages=pages)
        # The floors of one step that feeds one block per request over the prompt, with the experts such a
        # forward reaches (measured on random cached K/V before any request is added).
        routes = None
        if model.arch.num_experts:
            fill_cache(engine, seed=9)
            routes = routed_experts(engine, cached_context_plans(engine, batch, context, generator))
        f = floors(model, ceilings, batch, context, batch * BLOCK, touched(routes, model),
                   plan.kv_cache_dtype)
        plain_step_ms = None
        if plain is not None:
            block, positions, (past_k, past_v) = plain_inputs(model, batch, context, generator, device)
            with torch.inference_mode():
                plain_step_ms = device_ms(lambda: plain.decode_step(block, positions, past_k, past_v,
                                                                    engine.config.mask_token_id, 1), device,
                                          max(1, plan.reps // 2))
            del block, past_k, past_v
        for k in plan.tokens_per_step:
            params = SamplingParams(max_tokens=max_tokens, steps=BLOCK // k, ignore_eos=True)
            prompts = [random_prompt(context, model.arch.vocab_size, generator) for _ in range(batch)]
            requests = [engine.requests[engine.add_request(prompt, params)] for prompt in prompts]
            engine.step()  # prefill of every prompt, and the first step of the first block
            # Warm up over one whole block and its commit, so each bucket's graph is captured before timing.
            warm, timed = (1, 1) if plan.smoke else (BLOCK // k + 2, 2 * (BLOCK // k))
            for _ in range(warm):
                engine.step()
            decoded_before = sum(int((r.tokens[r.gen_start:] != engine.config.mask_token_id).sum()) for r in requests)
            synchronize(device)
            start = time.perf_counter()
            for _ in range(timed):
                engine.step()
            elapsed = time.perf_counter() - start
            decoded = sum(int((r.tokens[r.gen_start:] != engine.config.mask_token_id).sum()) for r in requests)
            step_ms = 1e3 * elapsed / timed
            for r in requests:
                engine.abort(r.request_id)
            plain_columns, plain_note = {}, PLAIN_SKIPPED
            if plain_step_ms is not None:
                plain_columns = dict(plain_ms=plain_step_ms, plain_tokens_per_s=batch * k / (plain_step_ms * 1e-3),
                                     engine_vs_plain=step_ms / plain_step_ms)
                plain_note = "plain: forward + confidence + top-k per step, no commit pass"
            report.add(section="decode_fixed_k", model=name, case=f"b{batch}_ctx{context}_k{k}", batch=batch,
                       context=context, k=k, tokens=batch * BLOCK, engine_step_ms=step_ms, **plain_columns, **f,
                       engine_vs_weight_floor=step_ms / f["weight_floor_ms"],
                       engine_vs_compute_floor=step_ms / f["compute_floor_ms"],
                       engine_tokens_per_s=(decoded - decoded_before) / elapsed,
                       **expert_columns(model, batch * BLOCK, routes),
                       note=f"{timed} steps timed after {warm + 1}; floors of one block per request over the "
                            f"{context}-token prompt (commit steps feed two); {plain_note}")
        del engine
        free_memory(device)


def timed_generation(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list[int]]:
    """(ms of each step, rows fed at each step) of the prompts' generation. It runs twice and the second is the one
    timed, so every bucket's graph was captured by the first."""
    for _ in range(2):
        for p in prompts:
            engine.add_request(p, params)
        step_times, fed = [], []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()  # ends in the step's read-back of its tokens: the device is done with it
            step_times.append(1e3 * (time.perf_counter() - start))
            if not engine.last_schedule.plans:
                raise RuntimeError("no request could be scheduled: the KV pool or token budget is too small")
            fed.append(engine.last_schedule.num_tokens)
    return step_times, fed


def diffulex_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    """The settings of Diffulex's own benchmark (timed_generation)."""
    generator = torch.Generator().manual_seed(2)
    prompt, new = plan.diffulex_prompt, plan.diffulex_new_tokens
    for strategy, buffer_size in (("multi_bd", 1), ("d2f", 4), ("fast_dllm_v2", 1), ("dmax", 1)):
        for batch in plan.diffulex_batches:
            engine = make_engine(model, model_dir, device, plan, decoding_strategy=strategy, buffer_size=buffer_size,
                                 max_model_len=prompt + new, max_num_reqs=batch,
                                 max_num_batched_tokens=max(4096, batch * BLOCK * (buffer_size + 1)),
                                 num_kv_pages=batch * -(-(prompt + new) // PAGE_SIZE))
            prompts = [random_prompt(prompt, model.arch.vocab_size, generator) for _ in range(batch)]
            step_times, fed = timed_generation(engine, prompts, SamplingParams(max_tokens=new, ignore_eos=True))
            decode = step_times[1:]  # the first step prefills every prompt
            ms = statistics.mean(decode)
            report.add(section="diffulex", model=name, case=f"{strategy}_buffer{buffer_size}_b{batch}", batch=batch,
                       context=prompt, engine_step_ms=ms, tokens=round(statistics.mean(fed[1:])),
                       engine_tokens_per_s=batch * new / (sum(step_times) * 1e-3),
                       note=f"{len(step_times)} steps; ms/step over decode steps; median {statistics.median(decode):.2f}; "
                            f"with the prefill step {statistics.mean(step_times):.2f} ms/step; "
                            f"{batch * new / len(step_times):.2f} tokens decoded per step")
            del engine
            free_memory(device)


CANVASES_A_REQUEST = 2  # a DiffusionGemma request of the canvas sections: the prompt, then two canvases


def canvas_engine(model, model_dir: str, device, plan: Plan, batch: int) -> RandomWeightEngine:
    """An engine that decodes `batch` DiffusionGemma requests at once: a prompt of Diffulex's benchmark length, then
    CANVASES_A_REQUEST canvases each."""
    canvas, prompt = model.arch.canvas_length, plan.diffulex_prompt
    length = prompt + CANVASES_A_REQUEST * canvas
    return make_engine(model, model_dir, device, plan, decoding_strategy="diffusion_gemma", block_size=canvas,
                       max_model_len=length, max_num_reqs=batch,
                       max_num_batched_tokens=max(4096, batch * (prompt + canvas)),
                       num_kv_pages=batch * -(-length // PAGE_SIZE))


def canvas_prompts(model, plan: Plan, batch: int, generator: torch.Generator) -> list[list[int]]:
    # From byte 1: id 0 is DiffusionGemma's pad, which no prompt may hold.
    return [random_prompt(plan.diffulex_prompt, model.arch.vocab_size, generator, low=1) for _ in range(batch)]


def canvas_floors(model, ceilings: Ceilings, plan: Plan, batch: int, step_ms: float) -> dict:
    """The report's columns of a step's floors and the step against them: batch x canvas_length tokens over the
    prompt (the rows fed again when a canvas ends, and the first canvas's K/V, left out). With 8 of 128 experts a
    token, one 256-token canvas already reaches nearly every expert, so the weight floor takes the uniform-routing
    count of experts."""
    tokens = batch * model.arch.canvas_length
    f = floors(model, ceilings, batch, plan.diffulex_prompt, tokens, kv_cache_dtype=plan.kv_cache_dtype)
    return dict(context=plan.diffulex_prompt, tokens=tokens, engine_step_ms=step_ms, **f,
                engine_vs_weight_floor=step_ms / f["weight_floor_ms"],
                engine_vs_compute_floor=step_ms / f["compute_floor_ms"], **expert_columns(model, tokens, None))


def canvas_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    """DiffusionGemma's step: `batch` requests, each denoising one canvas a step (timed_generation, canvas_engine).
    A step feeds batch x canvas_length rows, and once a canvas ends its tokens again, causally, beside the next
    canvas; its floors are canvas_floors'."""
    arch = model.arch
    generator = torch.Generator().manual_seed(6)
    new = CANVASES_A_REQUEST * arch.canvas_length
    for batch in plan.diffulex_batches:
        engine = canvas_engine(model, model_dir, device, plan, batch)
        step_times, fed = timed_generation(engine, canvas_prompts(model, plan, batch, generator),
                                           SamplingParams(max_tokens=new, ignore_eos=True))
        denoise = step_times[1:]  # the first step prefills every prompt
        report.add(section="canvas", model=name, case=f"b{batch}", batch=batch,
                   **canvas_floors(model, ceilings, plan, batch, statistics.mean(denoise)),
                   engine_tokens_per_s=batch * new / (sum(step_times) * 1e-3),
                   note=f"{len(step_times)} steps, {statistics.mean(fed[1:]):.0f} rows fed a step on average; "
                        f"ms/step over the denoising steps, median {statistics.median(denoise):.2f}; "
                        f"{arch.schedule.max_denoising_steps} denoising steps at most a canvas of "
                        f"{arch.canvas_length}")
        del engine
        free_memory(device)


STEP_RANGES = ("schedule", "forward", "sample", "accept", "respond")  # the step's ranges (profiling.step_range)
PROFILED_STEPS = 5


def canvas_profile_section(report: Report, name: str, model, model_dir: str, device, plan: Plan,
                           ceilings: Ceilings):
    """Where a DiffusionGemma step goes, at the first of the plan's batches: torch.profiler over five steps after
    six, as the canvas section feeds them. Device time a step by kernel kind (kernel_kind) and in the step's forward
    and sample ranges, and the step's wall time: the wall time less the device's is host time the device does not
    overlap. Off a GPU the kinds are CPU time, without the torch ops themselves."""
    batch = plan.diffulex_batches[0]
    engine = canvas_engine(model, model_dir, device, plan, batch)
    params = SamplingParams(max_tokens=CANVASES_A_REQUEST * model.arch.canvas_length, ignore_eos=True)
    for prompt in canvas_prompts(model, plan, batch, torch.Generator().manual_seed(7)):
        engine.add_request(prompt, params)
    for _ in range(6):  # the prompts' step and every bucket's capture before the profile
        engine.step()
    cuda = device.type == "cuda"
    with device_profile(activities_for(device)) as prof:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            engine.step()
        step_ms = 1e3 * (time.perf_counter() - start) / PROFILED_STEPS
    kinds, ranges = {}, {}
    for event in prof.key_averages():
        ms = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3 / PROFILED_STEPS
        if event.key in STEP_RANGES:
            ranges[event.key] = ms
        else:
            kind = kernel_kind(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + ms
    kinds.pop("host", None)
    device_ms = sum(kinds.values())
    breakdown = ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]))
    report.add(section="canvas_profile", model=name, case=f"b{batch}", batch=batch,
               **canvas_floors(model, ceilings, plan, batch, step_ms),
               note=f"{'device' if cuda else 'CPU'} ms a step by kernel kind: {breakdown}; sum {device_ms:.2f}; "
                    f"in the forward range {ranges.get('forward', 0.0):.2f}, the sample range "
                    f"{ranges.get('sample', 0.0):.2f}; step wall time less the sum {step_ms - device_ms:.2f} "
                    f"({PROFILED_STEPS} steps under the profiler, after 6)")
    for request_id in list(engine.requests):
        engine.abort(request_id)
    del engine
    free_memory(device)


def check_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    """Kernels and graphs against the torch path on the same weights.

    A random model 32 layers deep amplifies rounding: the torch path in bf16 already departs from the same
    path in float32 (the weights cast up exactly). So each path is measured against the float32 torch path,
    on the logits of one forward over a random cache and on greedy generation; and the graph replay against
    the same padded forward run eagerly, which must match it bit for bit."""
    generator = torch.Generator().manual_seed(3)
    batch, context, new_tokens = (2, 64, BLOCK) if plan.smoke else (4, 512, 2 * BLOCK)
    pages = batch * -(-(context + 2 * BLOCK) // PAGE_SIZE)
    prompts = [random_prompt(context // 4, model.arch.vocab_size, generator) for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    reference_model = copy.deepcopy(model).to(torch.float32)
    paths = [(f"kernels + graphs, {dtype}", model, dict(attention_backend=plan.attention_backend)),
             (f"torch path, {dtype}", model, dict(attention_backend="torch", enforce_eager=True)),
             ("torch path, float32", reference_model, dict(attention_backend="torch", enforce_eager=True,
                                                           dtype="float32"))]
    logits, outputs, graph_note = {}, {}, ""
    for label, path_model, settings in paths:
        engine = make_engine(path_model, model_dir, device, plan, max_model_len=context + 2 * BLOCK,
                             max_num_reqs=batch, num_kv_pages=pages, **settings)
        fill_cache(engine, seed=4)
        plans = cached_context_plans(engine, batch, context, torch.Generator().manual_seed(5))
        logits[label] = engine_logits(engine, plans).float()
        forward = engine.runner.padded_forward
        if forward is not None:
            batch_inputs = engine.runner.build_batch(plans)
            bucket = forward.bucket_for(batch_inputs)
            with torch.inference_mode():
                replayed = forward.run(bucket, batch_inputs).clone()
                eager_forward = PaddedForward(path_model, engine.runner.kv_cache, engine.config, device)
                eager = eager_forward.run(bucket, batch_inputs)
            graph_note = (f"graph replay vs the same padded forward run eagerly: max |diff| "
                          f"{float((replayed - eager).abs().max()):.3g}; ")
        outputs[label] = [o.token_ids for o in engine.generate(prompts, params)]
        del engine
        free_memory(device)
    del reference_model
    free_memory(device)
    reference = logits["torch path, float32"]
    notes = []
    for label, _, _ in paths[:2]:
        rel = relative(logits[label], reference)
        argmax = float((logits[label].argmax(-1) == reference.argmax(-1)).float().mean())
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(outputs[label], outputs["torch path, float32"])]
        notes.append(f"{label}: logits rel err {rel:.2e}, argmax agrees on {100 * argmax:.1f}% of rows, greedy "
                     f"output equal to the float32 path for {first_diff.count(None)}/{batch} requests "
                     f"(first differing position per request: {first_diff})")
    rel = relative(logits[paths[0][0]], logits[paths[1][0]])
    report.add(section="check", model=name, case="kernels+graphs vs torch path", batch=batch, context=context,
               note=graph_note + "; ".join(notes) + f"; kernels vs torch path, both {dtype}: logits rel err {rel:.2e}")


def profile_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    """Where a forward's time goes (one block per request over a 512-token context, batch 1 and 32): the
    forward's matrix products alone, in one CUDA graph; and the device time of each kind of kernel in the eager
    forward. In a MoE layer the matrix products are the router, the routed experts through the fused-MoE kernel
    on the routing this forward's tokens get (its sort into tiles included), and the shared expert."""
    context = plan.contexts[0]
    # The plan's first batch and its largest up to 32 (1 and 32 by default), each once.
    batches = tuple(dict.fromkeys((plan.batches[0], max(b for b in plan.batches if b <= max(32, plan.batches[0])))))
    engine = make_engine(model, model_dir, device, plan, max_model_len=context + 2 * BLOCK,
                         max_num_reqs=max(batches), num_kv_pages=max(batches) * -(-(context + BLOCK) // PAGE_SIZE))
    fill_cache(engine, seed=7)
    dtype = model.embed_tokens.weight.dtype
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    for batch in batches:
        plans = cached_context_plans(engine, batch, context, torch.Generator().manual_seed(8))
        routes = routed_experts(engine, plans)
        forward_ms = device_ms(lambda: engine_logits(engine, plans), device, plan.reps)
        inputs = {}

        def x_for(weight):  # one random input per input width
            size = weight.shape[-1]
            if size not in inputs:
                inputs[size] = torch.randn(batch * BLOCK, size, device=device, dtype=dtype)
            return inputs[size]

        cast = {}

        def project(proj, way: str = "one"):
            """A projection's product as the forward takes it: with the kernels, `one` product, split-K `partials`
            (o_proj, down_proj) or `gated` (gate_up, with SiLU-and-mul in a float product's epilogue and none in an
            fp8 one's, whose rows the SiLU-and-mul casts after it); an fp8 projection's rows cast once beforehand,
            as the kernels that write them cast them. Without the kernels, the torch module."""
            x = x_for(proj.weight)
            if not model.fused_kernels:
                return proj(x)
            if isinstance(proj, Fp8Linear):
                if x.shape[-1] not in cast:
                    cast[x.shape[-1]] = fused_forward.Fp8Rows(*quantize_rows(x), x.dtype)
                x = cast[x.shape[-1]]
            if way == "partials":
                return fused_forward._project_partials(proj, x)
            if way == "gated" and not isinstance(proj, Fp8Linear):
                return fused_forward._project_silu_and_mul(proj, x)
            return fused_forward._project(proj, x)

        def matmuls():  # every product of the forward, as the fused forward calls them
            moe_index = 0
            for layer in model.layers:
                project(layer.attn.qkv_proj)
                project(layer.attn.o_proj, "partials")
                mlp = layer.mlp
                if isinstance(mlp, MoE):
                    x = x_for(mlp.w_gate_up)
                    if model.fused_kernels:  # the router, in float32
                        fused_forward._router_logits(mlp, x)
                    else:
                        torch.nn.functional.linear(x.float(), mlp.gate.weight.float())
                    ids, weights = routes[moe_index]
                    moe_index += 1
                    scales = (mlp.w_gate_up_scale, mlp.w_down_scale)
                    # The shared expert where the recorded forward ran it: among the routed experts (its ids
                    # follow theirs in the recorded routes), or as a dense MLP.
                    among_routed = fused_forward._shared_among_routed(mlp, x.shape[0]) if model.fused_kernels else None
                    if model.fused_kernels:
                        fused_moe(x, mlp.w_gate_up, mlp.w_down, ids, weights, w_gate_up_scale=scales[0],
                                  w_down_scale=scales[1], shared_experts=among_routed)
                    else:
                        experts_reference(x, mlp.w_gate_up, mlp.w_down, ids, weights, *scales)
                    if mlp.shared_experts is not None and among_routed is None:
                        project(mlp.shared_experts.gate_up_proj, "gated")
                        project(mlp.shared_experts.down_proj, "partials")
                else:
                    project(mlp.gate_up_proj, "gated")
                    project(mlp.down_proj, "partials")
            if isinstance(model.lm_head, Fp8Linear):  # fp8_lm_head
                project(model.lm_head)
            elif model.fused_kernels:
                linear(x_for(head), head)
            else:
                torch.nn.functional.linear(x_for(head), head)

        with torch.inference_mode():
            # The torch modules' experts (experts_reference) read their counts on the host, which no graph captures.
            if device.type == "cuda" and model.fused_kernels:
                matmul_ms = graph_replay_ms(matmuls, device, plan.reps)
            else:
                matmul_ms = wall_ms(matmuls, device)
            input_ids, positions, meta = engine.runner.build_batch(plans).to_device(device)
            model(input_ids, positions, meta, engine.runner.kv_cache)  # warm
            activity = (torch.profiler.ProfilerActivity.CUDA if device.type == "cuda"
                        else torch.profiler.ProfilerActivity.CPU)
            with device_profile([activity]) as prof:
                model.compute_logits(model(input_ids, positions, meta, engine.runner.kv_cache))
                synchronize(device)
        kinds: dict[str, list] = {}  # kind -> [device ms, launches]
        for event in prof.key_averages():
            us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
            kind = kernel_kind(event.key)
            if kind != "host" and us > 0:
                totals = kinds.setdefault(kind, [0.0, 0])
                totals[0] += us / 1e3
                totals[1] += event.count
        # At a decode step's few rows each launch also costs its gap in the graph: the counts say how many there are.
        breakdown = ", ".join(f"{kind} {ms:.2f} ({launches})"
                              for kind, (ms, launches) in sorted(kinds.items(), key=lambda kv: -kv[1][0]))
        timeline = step_timeline(engine, plans, device, plan.reps) + step_phases(engine, plans, device, plan.reps)
        parts = forward_parts(engine, plans, device, plan.reps)
        total_ms, launches = sum(ms for ms, _ in kinds.values()), sum(n for _, n in kinds.values())
        f = floors(model, ceilings, batch, context, batch * BLOCK, touched(routes, model),
                   plan.kv_cache_dtype)
        floor_ms = max(f["weight_floor_ms"], f["compute_floor_ms"])
        report.add(section="profile", model=name, case=f"b{batch}_ctx{context}", batch=batch, context=context,
                   tokens=batch * BLOCK, engine_ms=forward_ms, **f,
                   engine_vs_weight_floor=forward_ms / f["weight_floor_ms"],
                   engine_vs_compute_floor=forward_ms / f["compute_floor_ms"],
                   **expert_columns(model, batch * BLOCK, routes),
                   note=f"the forward's matmuls alone, in one graph: {matmul_ms:.2f} ms "
                        f"({matmul_ms / floor_ms:.2f}x the larger floor); eager forward, device ms (launches) by "
                        f"kernel kind: {breakdown}; sum {total_ms:.2f} in {launches} launches{parts}{timeline}")
    del engine
    free_memory(device)


def forward_parts(engine, plans: list[SeqPlan], device, reps: int) -> str:
    """The forward's time without the host's work before it: with the batch built beforehand, its input copy and
    graph replay (the runner's forward), and the replay of the captured graph alone; beside the whole forward (the
    batch built, the replay, the LM head), they place the time between the forward's kernels and its end. Then
    the host's own time for the batch, its logit rows and the forward's launch, with the device idle."""
    runner = engine.runner
    batch = runner.build_batch(plans)
    with torch.inference_mode():
        ready_ms = device_ms(lambda: runner.forward(batch), device, reps)
        launch_ms = host_ms(lambda: runner.forward(batch), device, reps)
    host = (f"; on the host, the device idle: building the batch "
            f"{host_ms(lambda: runner.build_batch(plans), device, reps):.3f} ms, its logit rows "
            f"{host_ms(lambda: runner.logit_rows(plans), device, reps):.3f} ms, the forward's launch {launch_ms:.3f} ms")
    padded = runner.padded_forward
    bucket = padded.bucket_for(batch) if padded is not None else None
    graph = getattr(padded, "graphs", {}).get((bucket, False), (None,))[0]
    if graph is None:
        return f"; with the batch built beforehand, its copy and forward {ready_ms:.3f} ms (no graph){host}"
    replay_ms = device_ms(graph.replay, device, reps)
    return (f"; with the batch built beforehand, its copy and replay {ready_ms:.3f} ms, the graph's replay alone "
            f"{replay_ms:.3f} ms{host}, the graph's replay alone {host_ms(graph.replay, device, reps):.3f} ms")


def host_ms(fn, device: torch.device, reps: int) -> float:
    """Median host time of fn until it returns, each call after the device has finished the one before."""
    times = []
    for _ in range(reps + 1):
        synchronize(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def step_timeline(engine, plans: list[SeqPlan], device, reps: int) -> str:
    """The whole step (runner.execute: the forward, sampling and acceptance, and the one wait for their tokens):
    its wall time without the profiler; then three steps back to back under the profiler, tracing the host and the
    device: the device's busy time a step, and the gaps of over 15 us in which it sat idle (within a step and
    between two), the largest named with the host's longest CUDA call inside it. The profiler's tracing lengthens
    the host's calls, a CUDA graph's launch most: the wall time beside the busy time is the measure of what the
    device waits for without it."""
    sched = SchedulerOutput(plans=plans)
    with torch.inference_mode():
        engine.runner.execute(sched)
        wall = statistics.median(wall_ms(lambda: engine.runner.execute(sched), device) for _ in range(reps + 1))
        with device_profile(activities_for(device)) as prof:
            for _ in range(3):
                engine.runner.execute(sched)
                synchronize(device)
    on_device = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    on_host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type != torch.autograd.DeviceType.CUDA]
    if not on_device:
        return f"; the step {wall:.3f} ms (no device to trace)"
    busy, steps_span, gaps = busy_and_gaps(on_device)
    gaps = [gap for gap in gaps if gap[0] > 15]  # between the steps as within them

    def longest_call(start: float, end: float) -> str:
        calls = [(min(c_end, end) - max(c_start, start), name) for c_start, c_end, name in on_host
                 if name.startswith("cu") and c_end > start and c_start < end]
        return max(calls)[1] if calls else "none"

    largest = ", ".join(f"{us:.0f} us before {after[:40]} (the host in {longest_call(start, end)})"
                        for us, start, end, after in sorted(gaps, reverse=True)[:2])
    return (f"; the step {wall:.3f} ms without the profiler; under it, the device busy {busy / 3e3:.3f} ms a step "
            f"over {steps_span / 3e3:.3f} ms, idle {sum(g[0] for g in gaps) / 3e3:.3f} ms a step in gaps over "
            f"15 us, the largest: {largest or 'none'}")


def step_phases(engine, plans: list[SeqPlan], device, reps: int) -> str:
    """The whole step (runner.execute) split into its phases without the profiler, each the median over `reps` steps
    begun with the device idle: on the device, when the host calls the forward (before it queues the input copy and
    the graph: the device is idle until then), when the graph ends, when the logits, the sampler's and the
    acceptance's kernels end (CUDA events recorded around the runner's calls); on the host, when it has queued the
    forward and the acceptance, and when the step returns. A device time later than the host's queueing of the next
    phase is the device's; one earlier says that the device waited for the host."""
    if device.type != "cuda":
        return ""
    runner = engine.runner
    model = runner.model
    marks: dict[str, list[float]] = {}
    events: dict[str, torch.cuda.Event] = {}

    def mark(name: str) -> None:
        events[name] = torch.cuda.Event(enable_timing=True)
        events[name].record()
        marks.setdefault(f"host {name}", []).append(time.perf_counter())

    def around(obj, attr: str, before: str | None, after: str):
        call = getattr(obj, attr)

        def timed(*args, **kwargs):
            if before is not None:
                mark(before)
            result = call(*args, **kwargs)
            mark(after)
            return result
        setattr(obj, attr, timed)

    sched = SchedulerOutput(plans=plans)
    phases: dict[str, list[float]] = {}
    try:
        around(runner, "forward", "forward called", "graph ends")
        around(model, "compute_logits", None, "logits end")
        around(runner, "accept", "sampler ends", "acceptance ends")
        with torch.inference_mode():
            for rep in range(reps + 2):
                events.clear()
                marks.clear()
                synchronize(device)
                mark("step")
                runner.execute(sched)
                returned = time.perf_counter()
                synchronize(device)
                if rep < 2:
                    continue
                start, host_start = events["step"], marks["host step"][0]
                for name, event in events.items():
                    if name != "step":
                        phases.setdefault(name, []).append(start.elapsed_time(event))
                phases.setdefault("host queued the forward", []).append(
                    1e3 * (marks["host graph ends"][0] - host_start))
                phases.setdefault("host queued the acceptance", []).append(
                    1e3 * (marks["host acceptance ends"][0] - host_start))
                phases.setdefault("host returns", []).append(1e3 * (returned - host_start))
    finally:  # the runner's own methods again, whichever were wrapped
        for obj, attr in ((runner, "forward"), (model, "compute_logits"), (runner, "accept")):
            obj.__dict__.pop(attr, None)
    return ("; the step's phases, ms from its start (median of " + str(reps) + " steps, no profiler): "
            + ", ".join(f"{name} {statistics.median(times):.3f}" for name, times in phases.items()))


def busy_and_gaps(events: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, float, float, str]]]:
    """Of device events (start, end, name) sorted by start: the time covered by at least one of them (their union:
    a dependent launch's event starts while the kernel before it still runs, so their sum counts that time twice),
    the span from the first start to the last end, and each gap in which none runs, as (length, start, end, the
    name of the event after it)."""
    gaps = []
    last_end = events[0][1]
    for start, end, name in events[1:]:
        if start > last_end:
            gaps.append((start - last_end, last_end, start, name))
        last_end = max(last_end, end)
    span = last_end - events[0][0]
    return span - sum(gap[0] for gap in gaps), span, gaps


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, marks in (("fp8 cast", ("quantize_rows", "cast_chunks")),
                        ("moe experts", ("_gate_up_kernel", "_down_kernel", "_combine_kernel")),
                        ("moe routing", ("_count_experts", "_plan_runs", "_scatter_pairs", "sort", "topk")),
                        ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "aten::mm", "aten::addmm",
                                    "linear_kernel", "splitkreduce")),
                        ("attention", ("paged_attention", "merge_splits")), ("kv store", ("store_kv",)),
                        ("rmsnorm", ("rmsnorm",)), ("rope", ("rotary",)), ("silu*up", ("silu",)),
                        ("sampler", ("sample_and_confidence", "merge_chunks", "canvas_probs")),
                        ("copies", ("memcpy", "memset", "copy"))):
        if any(mark in lowered for mark in marks):
            return kind
    # The host's calls (cudaLaunchKernel, aten:: ops), which the CUDA profile lists beside the kernels; a kernel of
    # aten's may hold "cuda" further in its name (arange_cuda_out) and is one.
    if lowered.startswith(("aten::", "cuda", "profiler")):
        return "host"
    return "other"


def memory_section(report: Report, name: str, model, model_dir: str, device, plan: Plan, ceilings: Ceilings):
    """KV pool sizing from gpu_memory_utilization after a profiling forward, and what the device holds against
    what it allows: once the engine is built (warmed up, its CUDA graphs captured), at the peak, and after
    generating, with the CUDA graphs' memory pool and the streams the caching allocator holds memory on."""
    if device.type != "cuda":
        return
    utilization = 0.6
    torch.cuda.reset_peak_memory_stats(device)
    engine = make_engine(model, model_dir, device, plan, gpu_memory_utilization=utilization, max_model_len=2048)
    built = device_used(device)
    pages = engine.kv_cache.num_pages
    generator = torch.Generator().manual_seed(6)
    engine.generate([random_prompt(512, model.arch.vocab_size, generator) for _ in range(8)],
                    SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True))
    used = device_used(device)
    # The allocator's peak, plus what the process holds outside it (CUDA's context, loaded modules), as now.
    peak = torch.cuda.max_memory_reserved(device) + used - torch.cuda.memory_reserved(device)
    segments = torch.cuda.memory_snapshot()
    graphs = getattr(engine.runner.padded_forward, "graphs", {})
    pool = sum(s["total_size"] for s in segments if s["segment_pool_id"] != (0, 0))  # private pools: the graphs' one
    streams = len({s["stream"] for s in segments})
    allowed = utilization * torch.cuda.mem_get_info(device)[1]
    report.add(section="memory", model=name, case=f"gpu_memory_utilization={utilization}",
               note=f"{pages} KV pages ({pages * page_bytes(model, plan.kv_cache_dtype) / 1e9:.1f} GB); of the "
                    f"{allowed / 1e9:.3f} GB allowed the device holds {built / 1e9:.3f} GB once the engine is built, "
                    f"{peak / 1e9:.3f} GB at the peak and {used / 1e9:.3f} GB after generating; {len(graphs)} CUDA "
                    f"graphs, their pool {pool / 1e9:.3f} GB; the allocator holds memory on {streams} streams")
    del engine
    free_memory(device)


def device_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# In the order they run: the main table first, then the end-to-end runs, the checks, the pool sizing.
SECTIONS = {"forward": forward_section, "decode": decode_section, "diffulex": diffulex_section,
            "canvas": canvas_section, "canvas_profile": canvas_profile_section, "check": check_section,
            "profile": profile_section, "memory": memory_section}


# ---- output ----------------------------------------------------------------------------------------------------

def write_markdown(report: Report, ceilings: Ceilings, command: str) -> None:
    lines = [f"`{command}`", "",
             f"HBM copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s (read + write); "
             f"bf16 matmul {ceilings.matmul_rate / 1e12:.0f} TFLOP/s"
             + (f"; fp8 matmul {ceilings.fp8_matmul_rate / 1e12:.0f} TFLOP/s" if ceilings.fp8_matmul_rate else ""),
             ""]
    for section in ("forward", "decode_fixed_k", "diffulex", "canvas", "canvas_profile", "check", "profile", "memory"):
        rows = [r for r in report.rows if r["section"] == section]
        if not rows:
            continue
        columns = [c for c in FIELDS if c != "section" and any(r.get(c) not in (None, "") for r in rows)]
        lines += [f"### {section}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
        lines.append("")
    (report.out / "forward.md").write_text("\n".join(lines))


def plot(report: Report, name: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r["section"] == "forward" and r["model"] == name]
    if not rows:
        return
    contexts = sorted({int(r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        sub = sorted((r for r in rows if int(r["context"]) == context), key=lambda r: int(r["batch"]))
        batches = [int(r["batch"]) for r in sub]
        for key, label, style in (("engine_ms", "engine forward (graphs, kernels)", "o-"),
                                  ("plain_ms", "plain PyTorch, eager", "s--"),
                                  ("plain_graph_ms", "plain PyTorch, one CUDA graph", "^--"),
                                  ("weight_floor_ms", "weight-streaming floor", "k:"),
                                  ("compute_floor_ms", "compute floor", "k-."),
                                  ("memory_floor_ms", "weights + KV over bandwidth", "c:")):
            values = [float(r[key]) if r.get(key) not in ("", None) else math.nan for r in sub]
            ax.plot(batches, values, style, label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch (32-token block each)", ylabel="ms per forward",
               title=f"{name}, context {context}")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.out / f"forward_{name}.png", dpi=120)


QUANTIZATIONS = ("none", "fp8")  # in the order a run takes them: fp8 quantizes the bf16 weights in place


def quantized(model, quantization: str):
    """The model over the same weights, quantized as `quantization: fp8` quantizes at load; none: as it is."""
    if quantization == "fp8":
        quantize_model(model)
    return model


# How far fp8 weights may move a forward from the float weights they were quantized from. Rounding to e4m3 (3 mantissa
# bits) with a scale at each row's absolute maximum leaves a Gaussian row an RMS relative error of 2.65%, and a product
# of two such operands (the activations' per-token cast, the weight's per-channel one) 3.75%. A layer's update chains
# two products in each of its sublayers (qkv then o_proj, gate_up then down), about 5.3%, which leaves out that the
# gated MLP's SiLU(gate) * up multiplies two rounded products before the second. The bound, 0.10, leaves room for that
# and for the softmax's sensitivity. With every layer fed the float forward's input, the output's error is the last
# layer's and the head's alone. A MoE layer has no bound: its router (float32, over the unquantized router weights)
# takes the input the fp8 attention moved, and a token whose top-k experts change on a near tie takes other experts'
# outputs, a difference no rounding bounds.
FP8_LAYER_BOUND = 0.10  # |fp8 layer output - float layer output| / |float layer's update (output - input)|
FP8_OUTPUT_BOUND = 0.10  # |fp8 logits - float logits| / |float logits|, every layer fed the float input


class LayerTap:
    """Hooks on every decoder layer that record each layer's input and output. With `feed` (another forward's
    inputs), each layer takes the input it had there instead of the one the layers before it gave it, so a layer's
    difference from that forward is its own and not the sum of those before it."""

    def __init__(self, layers, feed: list[torch.Tensor] | None = None):
        self.layers, self.feed = layers, feed
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def __enter__(self):
        def before(module, args):
            index = len(self.inputs)
            x = args[0] if self.feed is None else self.feed[index]
            self.inputs.append(x.clone())
            return (x, *args[1:])

        def after(module, args, output):
            self.outputs.append(output.clone())

        self.handles = [h for layer in self.layers
                        for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


@dataclass
class CheckForward:
    """One forward of 4 blocks over the same random cache, whatever the weights: what fp8 weights are held to the
    float weights they were quantized from by."""
    logits: torch.Tensor  # the engine's forward (kernels and graphs where the engine takes them)
    module_logits: torch.Tensor  # the torch modules' forward, layer by layer
    layer_inputs: list[torch.Tensor]
    layer_outputs: list[torch.Tensor]


def check_logits(model, model_dir: str, device, plan: Plan, tap: LayerTap | None = None, **settings) -> torch.Tensor:
    """The logits of one forward of 4 blocks over the same random cache, whatever the weights; `tap` on the
    forward alone, not on the engine's warm-up."""
    engine = make_engine(model, model_dir, device, plan, max_model_len=plan.decode_context + 2 * BLOCK,
                         max_num_reqs=4, num_kv_pages=4 * -(-(plan.decode_context + 2 * BLOCK) // PAGE_SIZE),
                         **settings)
    fill_cache(engine, seed=4)
    plans = cached_context_plans(engine, 4, plan.decode_context, torch.Generator().manual_seed(5))
    with tap or contextlib.nullcontext():
        logits = engine_logits(engine, plans).float()
    del engine
    free_memory(device)
    return logits


def check_forward(model, model_dir: str, device, plan: Plan, feed: list[torch.Tensor] | None = None) -> CheckForward:
    """The engine's logits, then the torch modules' with each layer's input and output (each layer fed `feed`'s
    input when given); only the torch modules have layers to hook. Their fp8 projections run as the fused forward's
    do (the W8A8 kernels on CUDA, the float32 reference elsewhere), but a MoE layer's routed experts dequantize
    their fp8 stacks and multiply the tokens as they are (weight-only), where the fused forward's kernel casts the
    tokens to fp8 too."""
    logits = check_logits(model, model_dir, device, plan)
    tap = LayerTap(model.layers, feed)
    module_logits = check_logits(model, model_dir, device, plan, tap, attention_backend="torch", enforce_eager=True)
    if len(tap.inputs) != len(model.layers):
        raise RuntimeError(f"the torch modules' forward ran {len(tap.inputs)} decoder layers of {len(model.layers)}")
    return CheckForward(logits, module_logits, tap.inputs, tap.outputs)


def fp8_against_float(report: Report, name: str, model, fp8: CheckForward, float_: CheckForward, context: int,
                      float_dtype: torch.dtype) -> None:
    """Rows of the fp8 weights' forward against the float weights': each layer fed the float forward's input and
    held to FP8_LAYER_BOUND (a dense one), the output so fed held to FP8_OUTPUT_BOUND (after a dense last layer),
    and the engine's whole forward, whose difference each layer's compounds (a random model many layers deep
    amplifies any rounding, which the check section shows of bf16 against float32), with no bound."""
    dtype = str(float_dtype).removeprefix("torch.")
    dense = [not any(isinstance(m, (MoE, GemmaMoE)) for m in layer.modules()) for layer in model.layers]

    def bounded(error: float, bound: float, applies: bool) -> dict:
        if not applies:
            return dict(error=error)
        if error > bound:
            print(f"{name}: an fp8 difference of {error:.4g} is past its bound {bound}", flush=True)
        return dict(error=error, bound=bound, within=error <= bound)

    for index, (out, ref_in, ref_out) in enumerate(zip(fp8.layer_outputs, float_.layer_inputs,
                                                       float_.layer_outputs, strict=True)):
        out, ref_in, ref_out = out.float(), ref_in.float(), ref_out.float()
        error = float((out - ref_out).norm() / (ref_out - ref_in).norm())
        report.add(section="check", model=name, case=f"fp8_layer_{index}", batch=4, context=context,
                   **bounded(error, FP8_LAYER_BOUND, dense[index]),
                   note=f"{'dense' if dense[index] else 'MoE'} layer {index} over the {dtype} forward's input: its "
                        f"output against the {dtype} layer's, relative to that layer's update (output - input)")
    argmax = float((fp8.module_logits.argmax(-1) == float_.module_logits.argmax(-1)).float().mean())
    report.add(section="check", model=name, case="fp8_output_layers_fed", batch=4, context=context,
               **bounded(relative(fp8.module_logits, float_.module_logits), FP8_OUTPUT_BOUND, dense[-1]),
               note=f"logits with every layer fed the {dtype} forward's input, against the {dtype} weights': argmax "
                    f"agrees on {100 * argmax:.1f}% of rows")
    argmax = float((fp8.logits.argmax(-1) == float_.logits.argmax(-1)).float().mean())
    report.add(section="check", model=name, case="fp8_vs_float_weights", batch=4, context=context,
               error=relative(fp8.logits, float_.logits),
               note=f"the engine's logits of fp8 weights against the {dtype} weights they were quantized from, one "
                    f"forward over the same cache and blocks, each layer's difference compounded: argmax agrees on "
                    f"{100 * argmax:.1f}% of rows")


# The sections that read the float weights themselves (the float32 reference copy).
FLOAT_ONLY_SECTIONS = ("check",)


def parse_list(text: str, choices=None, cast=str) -> tuple:
    values = tuple(cast(v) for v in text.split(","))
    if choices is not None and (bad := [v for v in values if v not in choices]):
        raise SystemExit(f"{bad} not among {list(choices)}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--models", help=f"comma-separated, of {sorted(RELEASED_SHAPES) + sorted(CANVAS_SHAPES)} "
                                         f"(default llada-8b), or with --smoke of {sorted(SMOKE_MODELS)} (default "
                                         "smoke,smoke-moe)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one iteration of each case")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the engine's KV cache: the model's dtype, or FP8 rows (kv_cache_dtype)")
    parser.add_argument("--quantization", default="none",
                        help="comma-separated, of none (bf16 weights) and fp8 (the same weights quantized as "
                             "`quantization: fp8` does), run in that order over one model")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "flash_attn"],
                        help="the engines' attention_backend (the torch paths' rows keep torch)")
    parser.add_argument("--batches", help="comma-separated batches of every section (default: the plan's)")
    parser.add_argument("--contexts", help="comma-separated cached contexts of the forward section")
    args = parser.parse_args(argv)
    command = "python benchmarks/forward.py " + " ".join(argv if argv is not None else sys.argv[1:])
    sections = parse_list(args.sections, SECTIONS)
    quantizations = parse_list(args.quantization, QUANTIZATIONS)
    if list(quantizations) != sorted(set(quantizations), key=QUANTIZATIONS.index):
        raise SystemExit(f"--quantization {args.quantization}: each at most once, in the order {QUANTIZATIONS}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = dataclasses.replace(SMOKE if args.smoke else FULL, kv_cache_dtype=args.kv_cache_dtype,
                               attention_backend=args.attention_backend)
    if args.batches:
        batches = parse_list(args.batches, cast=int)
        plan = dataclasses.replace(plan, batches=batches, decode_batches=batches, diffulex_batches=batches)
    if args.contexts:
        plan = dataclasses.replace(plan, contexts=parse_list(args.contexts, cast=int))
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: more CPU threads only add synchronization
    report = Report(args.out)
    ceilings = measure_ceilings(device, plan, fp8="fp8" in quantizations)
    report.add(section="ceiling", case="hbm_copy", note=f"{ceilings.bandwidth / 1e12:.3g} TB/s read + write")
    report.add(section="ceiling", case="bf16_matmul", note=f"{ceilings.matmul_rate / 1e12:.3g} TFLOP/s")
    if ceilings.fp8_matmul_rate:
        report.add(section="ceiling", case="fp8_matmul", note=f"{ceilings.fp8_matmul_rate / 1e12:.3g} TFLOP/s")
    shapes = SMOKE_MODELS if args.smoke else {**RELEASED_SHAPES, **CANVAS_SHAPES}
    names = parse_list(args.models or ("smoke,smoke-moe" if args.smoke else "llada-8b"), shapes)
    models = {m: shapes[m] for m in names}
    # A context past the released limit (LLaDA-8B's is 4096) raises it, as long_prompt_setup does: random weights
    # cost the same at any position.
    longest = max(plan.contexts) + 2 * BLOCK
    models = {m: dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], longest))
              for m, shape in models.items()}
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, shape in models.items():
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
            model, model_dir = build_model(shape, pathlib.Path(tmp) / model_name, dtype, device, args.smoke)
            float_forward = None
            for quantization in quantizations:
                name = model_name if quantization == "none" else f"{model_name}-{quantization}"
                # A canvas model's forward runs under its own strategy alone (the canvas sections).
                if quantization == "fp8" and "none" in quantizations and not is_canvas_model(shape):
                    float_forward = check_forward(model, model_dir, device, plan)
                model = quantized(model, quantization)
                for section in sections:
                    if (section in CANVAS_SECTIONS) != is_canvas_model(shape):
                        print(f"{name} {section}: not run (canvas models run {', '.join(CANVAS_SECTIONS)}, and only "
                              "they)", flush=True)
                        continue
                    if has_fp8(model) and section in FLOAT_ONLY_SECTIONS:
                        print(f"{name} {section}: not run over fp8 weights (it reads the float weights)", flush=True)
                        continue
                    start = time.perf_counter()
                    try:
                        SECTIONS[section](report, name, model, model_dir, device, plan, ceilings)
                    except Exception:  # one broken section must not cost the device time of the others
                        failures += 1
                        traceback.print_exc()
                        free_memory(device)
                    print(f"{name} {section}: {time.perf_counter() - start:.0f} s", flush=True)
                if float_forward is not None:
                    fp8_forward = check_forward(model, model_dir, device, plan, feed=float_forward.layer_inputs)
                    fp8_against_float(report, name, model, fp8_forward, float_forward, plan.decode_context, dtype)
                    float_forward = None
                plot(report, name)
            del model
            free_memory(device)
    write_markdown(report, ceilings, command)
    print(f"wrote {args.out / 'forward.csv'} and {args.out / 'forward.md'}", flush=True)
    if failures:
        sys.exit(f"{failures} section(s) failed")


if __name__ == "__main__":
    main()
