"""Kernel microbenchmarks: each kernel against its torch reference and against its floor.

The floors come from two ceilings measured in the same run: HBM bandwidth (a large device-to-device copy,
bytes read plus bytes written) and the bf16 matmul rate (8192^3). A kernel's floor is the larger of
(bytes it must move / bandwidth) and (flops / matmul rate). Times are medians,
with the L2 cache cleared before every call, so each call reads its inputs from HBM as a forward's layers do.
Kernels are timed twice: replayed from a CUDA graph (device time, as the engine's graphs run them) and
launched from Python (what an eager forward pays); the torch references are timed eagerly.

    python benchmarks/kernels.py [--out DIR] [--sections attention,attention_sweep]   # on a GPU: LLaDA-8B, Dream-7B
    python benchmarks/kernels.py --smoke       # anywhere: tiny shapes, one call each (CPU: interpreter)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import pathlib
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import triton  # noqa: E402
import diffulex_kernels  # noqa: E402
from diffulex_backend.acceptance import AcceptanceBatch, AcceptanceRule  # noqa: E402
from diffulex_backend.attention import AttentionMetadata, paged_attention_reference  # noqa: E402
from diffulex_backend.sampling import SamplingMode  # noqa: E402
from diffulex_backend.attention import store_kv as store_kv_reference  # noqa: E402
from diffulex_backend.sampling import row_keys, sample_reference  # noqa: E402
from diffulex_kernels.attention import AttentionLaunch, plan_launch  # noqa: E402
from diffulex_kernels.device import multiprocessor_count  # noqa: E402
from diffulex_kernels.kv_store import pack_fp8_rows  # noqa: E402
from diffulex_kernels.sampling import SamplerLaunch, plan_sampler_launch  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int


FULL_MODELS = [
    ModelShape("LLaDA-8B", heads=32, kv_heads=32, head_dim=128, hidden=4096, vocab=126464),
    ModelShape("Dream-7B", heads=28, kv_heads=4, head_dim=128, hidden=3584, vocab=152064),
    ModelShape("SDAR-8B", heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=151936),
]
SMOKE_MODELS = [ModelShape("tiny", heads=4, kv_heads=2, head_dim=64, hidden=96, vocab=1000)]
BLOCK_LEN = 32  # query tokens per request: one diffusion block
PAGE_SIZE = 32


@dataclass
class Row:
    kernel: str
    case: str
    kernel_ms: float  # in a CUDA graph
    eager_ms: float  # launched from Python
    reference_ms: float  # the torch reference, eager
    bytes_moved: float
    flops: float
    floor_ms: float = math.nan
    note: str = ""


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s
    matmul_rate: float  # flop/s

    def floor_ms(self, bytes_moved: float, flops: float) -> float:
        return 1e3 * max(bytes_moved / self.bandwidth, flops / self.matmul_rate)


def time_eager_ms(fn) -> float:
    """Median time of one call launched from Python, L2 cleared before each (what an eager forward sees)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def time_graph_ms(fn, calls: int = 10, replays: int = 15) -> float:
    """Median device time of one call replayed from a CUDA graph (as the engine's graphs run it), with the
    L2 cache cleared before each call: graph(clear + call) minus graph(clear), per call."""
    if not torch.cuda.is_available():
        return time_eager_ms(fn)
    l2_clear = torch.empty(128 << 20, dtype=torch.int8, device="cuda")  # 2.5x the H100's L2
    fn()  # compile outside the capture
    torch.cuda.synchronize()

    def replay_ms(body) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                l2_clear.zero_()
                body()
        graph.replay()  # warm
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    return (replay_ms(fn) - replay_ms(lambda: None)) / calls


def measure_ceilings(device: torch.device, smoke: bool) -> Ceilings:
    n = 1 << (16 if smoke else 30)  # 2 GiB of bf16 on the GPU
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_eager_ms(lambda: dst.copy_(src))
    m = 256 if smoke else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    matmul_ms = time_eager_ms(lambda: a @ b)
    return Ceilings(bandwidth=2 * src.numel() * 2 / (copy_ms * 1e-3), matmul_rate=2 * m**3 / (matmul_ms * 1e-3))


def device_header(device: torch.device, ceilings: Ceilings) -> str:
    """The lines that open a report: the device, the versions, and the ceilings measured on it."""
    return (
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}; "
        f"torch {torch.__version__}, triton {triton.__version__}\n"
        f"HBM copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s (read + write); "
        f"bf16 matmul {ceilings.matmul_rate / 1e12:.0f} TFLOP/s"
    )


def randn(*shape: int, device: torch.device, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


def attention_inputs(model: ModelShape, batch: int, context: int, device: torch.device, block_len: int = BLOCK_LEN):
    """`batch` requests, each feeding one block of `block_len` tokens over `context` cached tokens; the
    block's K/V are stored (the committed-block case, the most bytes)."""
    pages_per_seq = triton.cdiv(context + block_len, PAGE_SIZE)
    num_pages = batch * pages_per_seq
    page_tables = torch.randperm(num_pages).view(batch, pages_per_seq).to(torch.int32)
    positions = context + torch.arange(block_len)
    slots = page_tables[:, positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE
    num_tokens = batch * block_len
    cu = tuple(range(0, num_tokens + 1, block_len))
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        page_tables=page_tables.to(device),
        slot_mapping=slots.reshape(-1).to(device),
        block_ids=torch.full((num_tokens,), context, dtype=torch.int32, device=device),
        max_seqlen_q=block_len,
        max_context_len=context,
        cu_seqlens_q_host=cu,
        context_lens_host=(context,) * batch,
    )
    d = model.head_dim
    tensors = dict(
        query=randn(num_tokens, model.heads, d, device=device),
        key=randn(num_tokens, model.kv_heads, d, device=device),
        value=randn(num_tokens, model.kv_heads, d, device=device),
        k_cache=randn(num_pages, PAGE_SIZE, model.kv_heads, d, device=device),
        v_cache=randn(num_pages, PAGE_SIZE, model.kv_heads, d, device=device),
    )
    element = 2  # bf16
    token_bytes = num_tokens * d * element
    bytes_moved = (
        2 * token_bytes * model.heads  # read q, write out
        + 4 * token_bytes * model.kv_heads  # read in-forward k, v; store them into the cache
        + 2 * batch * context * model.kv_heads * d * element  # read the cached context
    )
    flops = 4 * model.heads * d * num_tokens * (context + block_len)
    return tensors, meta, bytes_moved, flops


def bench_attention(models, batches, contexts, device) -> list[Row]:
    rows = []
    for model in models:
        scale = model.head_dim**-0.5
        for context in contexts:
            for batch in batches:
                t, meta, bytes_moved, flops = attention_inputs(model, batch, context, device)
                args = (t["query"], t["key"], t["value"], t["k_cache"], t["v_cache"], meta, scale)
                launch = plan_launch(t["query"], t["key"], meta)
                one_split = dataclasses.replace(launch, num_splits=1)
                kernel = lambda: diffulex_kernels.paged_attention(*args)  # noqa: E731
                kernel_ms = time_graph_ms(kernel)
                no_split_ms = kernel_ms if launch.num_splits == 1 else time_graph_ms(
                    lambda: diffulex_kernels.paged_attention(*args, launch=one_split)
                )
                rows.append(Row(
                    "paged_attention", f"{model.name} b{batch} ctx{context}", kernel_ms, time_eager_ms(kernel),
                    time_eager_ms(lambda: paged_attention_reference(*args)), bytes_moved, flops,
                    note=f"splits {launch.num_splits}; 1 split {no_split_ms:.4f} ms",
                ))
                del t
    return rows


def sweep_attention_launches(models, batches, context, device, grid: dict[str, tuple[int, ...]]) -> list[Row]:
    """Tile/warp/stage/split variants around the default plan, to check the defaults on this GPU."""
    rows = []
    for model in models:
        scale = model.head_dim**-0.5
        for batch in batches:
            t, meta, bytes_moved, flops = attention_inputs(model, batch, context, device)
            args = (t["query"], t["key"], t["value"], t["k_cache"], t["v_cache"], meta, scale)
            base = plan_launch(t["query"], t["key"], meta)
            variants = [base] + [
                dataclasses.replace(base, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                    num_splits=splits)
                for block_m in sorted({base.block_m, *grid["block_m"]})
                for block_n in grid["block_n"]
                for warps in grid["num_warps"]
                for stages in grid["num_stages"]
                for splits in sorted({max(1, base.num_splits * k // 4) for k in (1, 2, 4, 8)})
            ]
            for launch in dict.fromkeys(variants):  # unique, default first
                try:
                    ms = time_graph_ms(lambda: diffulex_kernels.paged_attention(*args, launch=launch))
                except triton.runtime.errors.OutOfResources:
                    continue  # the tile does not fit in shared memory
                rows.append(Row(
                    "paged_attention sweep", f"{model.name} b{batch} ctx{context}", ms, math.nan, math.nan,
                    bytes_moved, flops,
                    note=("default " if launch == base else "") + launch_label(launch),
                ))
            del t
    return rows


def attention_key_tiles(models, cases, device) -> list[Row]:
    """Each case's planned launch over bf16 rows and over FP8 rows (kv_cache_dtype fp8), beside the same launch with
    key tiles of the other width (64 and 128 keys): where the plan's key tiles stand against the alternative, split
    and unsplit. A case is (batch, context, block length); the in-forward keys are stored beforehand, as the fused
    forward stores them."""
    rows = []
    for model in models:
        scale = model.head_dim**-0.5
        for batch, context, block_len in cases:
            t, meta, bytes_moved, flops = attention_inputs(model, batch, context, device, block_len)
            base = plan_launch(t["query"], t["key"], meta)
            other = dataclasses.replace(base, block_n=128 if base.block_n == 64 else 64)
            for rows_name, caches in (("bf16 rows", (t["k_cache"], t["v_cache"])),
                                      ("FP8 rows", (pack_fp8_rows(t["k_cache"]), pack_fp8_rows(t["v_cache"])))):
                def call(launch, caches=caches):
                    return diffulex_kernels.paged_attention(t["query"], t["key"], t["value"], *caches, meta, scale,
                                                            launch=launch, kv_stored=True)
                other_ms = time_graph_ms(lambda: call(other))
                planned_ms = time_graph_ms(lambda: call(base))
                rows.append(Row(
                    "paged_attention key tiles", f"{model.name} b{batch} ctx{context} block{block_len} {rows_name}",
                    planned_ms, math.nan, math.nan, bytes_moved, flops,
                    note=f"planned {launch_label(base)}; {other.block_n} keys {other_ms:.4f} ms "
                         f"({planned_ms / other_ms:.3f} of it)",
                ))
            del t
    return rows


def launch_label(launch: AttentionLaunch) -> str:
    return (f"m{launch.block_m} n{launch.block_n} w{launch.num_warps} s{launch.num_stages} "
            f"splits{launch.num_splits}")


def kernel_row(kernel: str, case: str, run_kernel, run_reference, bytes_moved: float) -> Row:
    return Row(
        kernel, case, time_graph_ms(run_kernel), time_eager_ms(run_kernel), time_eager_ms(run_reference),
        bytes_moved, 0.0,
    )


def bench_store_kv(models, batches, device) -> list[Row]:
    rows = []
    for model in models:
        for batch in batches:
            t, meta, _, _ = attention_inputs(model, batch, 0, device)
            args = (t["key"], t["value"], t["k_cache"], t["v_cache"], meta.slot_mapping)
            bytes_moved = 4 * t["key"].numel() * 2
            rows.append(kernel_row(
                "store_kv", f"{model.name} b{batch}", lambda: diffulex_kernels.store_kv(*args),
                lambda: store_kv_reference(*args), bytes_moved,
            ))
    return rows


def bench_sampler(models, batches, device) -> list[Row]:
    rows = []
    for model in models:
        for batch in batches:
            n = BLOCK_LEN * batch
            logits = randn(n, model.vocab, device=device) * 3
            steps = torch.arange(n, device=device)
            keys = row_keys(torch.full((n,), 1234, device=device), steps, steps)
            kinds = steps % 3
            for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
                temperature = torch.full((n,), temp, device=device)
                args = (logits, temperature, keys, kinds)
                rows.append(kernel_row(
                    "sample_and_confidence", f"{model.name} {mode} N={n} V={model.vocab}",
                    lambda: diffulex_kernels.sample_and_confidence(*args), lambda: sample_reference(*args),
                    logits.numel() * 2,
                ))
            del logits
    return rows


def acceptance_batch(num_segs: int, device: torch.device) -> AcceptanceBatch:
    """One 32-position segment per block: a few positions still masked, thresholds that accept some of them."""
    n = num_segs * BLOCK_LEN
    mask_token = 0
    current = torch.randint(1, 1000, (n,), device=device)
    current[torch.rand(n, device=device) < 0.5] = mask_token
    logsumexp = torch.rand(n, device=device) * 2
    return AcceptanceBatch(
        current=current, predicted=torch.randint(1, 1000, (n,), device=device), confidence=torch.rand(n, device=device),
        current_logit=(logsumexp - torch.rand(n, device=device)).to(torch.bfloat16), logsumexp=logsumexp,
        seg_offsets=torch.arange(num_segs + 1, device=device) * BLOCK_LEN, max_segment_len=BLOCK_LEN,
        seg_first=torch.arange(num_segs, device=device) % 2 == 0, seg_enabled=torch.ones(num_segs, dtype=torch.bool, device=device),
        seg_accept_threshold=torch.full((num_segs,), 0.9, device=device),
        seg_remask_threshold=torch.full((num_segs,), 0.1, device=device),
        seg_num_transfer=torch.full((num_segs,), 2, device=device),
    )


def bench_acceptance(batches, device) -> list[Row]:
    """The acceptance rule over one block per request (and four, as d2f with four blocks in flight runs it)."""
    rows = []
    for blocks_per_request in (1, 4):
        for batch in batches:
            accept_batch = acceptance_batch(batch * blocks_per_request, device)
            # Read: current, predicted, confidence, logit, logsumexp; written: the tokens.
            bytes_moved = accept_batch.current.numel() * (8 + 8 + 4 + 2 + 4 + 8)
            for mode in SamplingMode:
                rule = AcceptanceRule(mode, mask_token_id=0)
                rows.append(kernel_row(
                    "accept_tokens", f"{mode.value} {batch} requests x {blocks_per_request} blocks",
                    lambda: rule(accept_batch, use_kernel=True), lambda: rule(accept_batch), bytes_moved,
                ))
    return rows


def sweep_sampler_launches(model: ModelShape, row_counts, device, grid: dict[str, tuple[int, ...]]) -> list[Row]:
    """Every tile width, warp count and chunk count of the grid, at row counts from a few masked positions of one
    block up to past the multiprocessor count."""
    rows = []
    for n in row_counts:
        logits = randn(n, model.vocab, device=device) * 3
        steps = torch.arange(n, device=device)
        keys = row_keys(torch.full((n,), 1234, device=device), steps, steps)
        default = plan_sampler_launch(n, model.vocab, multiprocessor_count(device))
        for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
            args = (logits, torch.full((n,), temp, device=device), keys, steps % 3)
            for block_v in grid["block_v"]:
                for warps in grid["num_warps"]:
                    for chunks in grid["num_chunks"]:
                        launch = SamplerLaunch(block_v=block_v, num_warps=warps, num_chunks=chunks)
                        ms = time_graph_ms(lambda: diffulex_kernels.sample_and_confidence(*args, launch=launch))
                        rows.append(Row(
                            "sample_and_confidence sweep", f"{model.name} {mode} N={n}", ms, math.nan, math.nan,
                            logits.numel() * 2, 0.0,
                            note=("default " if launch == default else "") + f"block_v {block_v} w{warps} chunks {chunks}",
                        ))
        del logits
    return rows


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rmsnorm_reference(x, residual, weight, eps):
    residual = x + residual
    return rmsnorm_reference(residual, weight, eps), residual


def bench_rmsnorm(models, batches, device) -> list[Row]:
    rows = []
    for model in models:
        for batch in batches:
            n = BLOCK_LEN * batch
            x = randn(n, model.hidden, device=device)
            residual = randn(n, model.hidden, device=device)
            weight = randn(model.hidden, device=device)
            case = f"{model.name} T={n}"
            rows.append(kernel_row(
                "rmsnorm", case, lambda: diffulex_kernels.rmsnorm(x, weight, 1e-5),
                lambda: rmsnorm_reference(x, weight, 1e-5), 2 * x.numel() * 2 + model.hidden * 2,
            ))
            rows.append(kernel_row(
                "fused_add_rmsnorm", case, lambda: diffulex_kernels.fused_add_rmsnorm(x, residual, weight, 1e-5),
                lambda: fused_add_rmsnorm_reference(x, residual, weight, 1e-5), 4 * x.numel() * 2 + model.hidden * 2,
            ))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [
        "| kernel | case | graph ms | floor ms | graph / floor | eager ms | reference ms | reference / eager | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kernel} | {r.case} | {r.kernel_ms:.4g} | {r.floor_ms:.4g} | {r.kernel_ms / r.floor_ms:.2f} | "
            f"{r.eager_ms:.4g} | {r.reference_ms:.4g} | {r.reference_ms / r.eager_ms:.1f} | {r.note} |"
        )
    return "\n".join(lines)


SECTIONS = ("attention", "store_kv", "sampler", "acceptance", "rmsnorm", "attention_sweep", "attention_key_tiles",
            "sampler_sweep")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one call each")
    parser.add_argument("--out", type=pathlib.Path, help="folder for kernels.md and kernels.csv")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.smoke:
        models, batches, contexts, sweep_batches = SMOKE_MODELS, [1], [40], [1]
        sweep_grid = {"block_m": (), "block_n": (32,), "num_warps": (4,), "num_stages": (2,)}
        sampler_grid = {"block_v": (256,), "num_warps": (4,), "num_chunks": (1, 3)}
        sampler_rows = (2,)
        key_tile_cases = [(1, 40, 32), (2, 40, 16)]
    else:
        models, batches, contexts, sweep_batches = FULL_MODELS, [1, 8, 32, 64], [512, 2048], [1, 64]
        sweep_grid = {"block_m": (128, 256), "block_n": (32, 64), "num_warps": (4, 8), "num_stages": (2,)}
        sampler_grid = {"block_v": (4096, 8192), "num_warps": (4, 8), "num_chunks": (1, 2, 4, 8, 16, 32)}
        sampler_rows = (8, 32, 128, 256)
        # Split launches (batch 1 to 4) and unsplit ones (batch 8 and 32), 32- and 16-token blocks.
        key_tile_cases = [(1, 2048, 32), (1, 32768, 32), (2, 4096, 32), (4, 4096, 32), (4, 16384, 32),
                          (1, 8192, 16), (4, 4096, 16), (8, 4096, 32), (32, 2048, 32)]

    ceilings = measure_ceilings(device, args.smoke)
    header = device_header(device, ceilings)
    print(header, flush=True)
    sections = {
        "attention": lambda: bench_attention(models, batches, contexts, device),
        "store_kv": lambda: bench_store_kv(models, batches, device),
        "sampler": lambda: bench_sampler(models, batches, device),
        "acceptance": lambda: bench_acceptance(batches, device),
        "rmsnorm": lambda: bench_rmsnorm(models, batches, device),
        "attention_sweep": lambda: sweep_attention_launches(models, sweep_batches, contexts[-1], device, sweep_grid),
        "attention_key_tiles": lambda: attention_key_tiles(models[:2], key_tile_cases, device),
        "sampler_sweep": lambda: sweep_sampler_launches(models[0], sampler_rows, device, sampler_grid),
    }
    rows = []
    for name in args.sections.split(","):
        section_rows = sections[name]()
        for row in section_rows:
            row.floor_ms = ceilings.floor_ms(row.bytes_moved, row.flops)
        print(format_table(section_rows), flush=True)  # as it goes, so a later failure keeps the earlier tables
        rows += section_rows
    table = format_table(rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.md").write_text(f"{header}\n\n{table}\n")
        with open(args.out / "kernels.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([field.name for field in dataclasses.fields(Row)])
            writer.writerows(dataclasses.astuple(r) for r in rows)


if __name__ == "__main__":
    main()
