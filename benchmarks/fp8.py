"""FP8 products at a decode step's shapes: LLaDA-8B's four projections (qkv, o, gate_up, down; hidden 4096,
intermediate 12288, 32 heads) at one block (32 rows) and at 32 blocks (1024 rows), each way the engine could run
them, against the floors measured in the same run.

Ways (each a layer's four products, over LAYERS layers whose weights are separate tensors, so each is read from HBM):
- bf16: `F.linear` on bf16 weights (cuBLAS), the baseline;
- scaled_mm: cuBLASLt FP8 (`torch._scaled_mm`, row-wise scales) on activations cast beforehand: the product alone;
- scaled_mm + torch cast: the same after a per-token cast in separate torch ops (amax, divide, cast);
- scaled_mm + fused cast: after `quantize_rows`, the one-pass Triton cast the engine uses;
- triton: the Triton `tl.dot` fp8 kernel (`fp8_matmul`) on activations cast beforehand;
- triton + fused cast: `quantize_rows` then the Triton kernel;
- triton W8A16: the same kernel weight-only: bf16 activations, fp8 weights widened to bf16 in registers, no cast;
- the engine's: the fused forward's own products (`_project`, `_project_partials`). qkv and gate_up take rows the
  norms cast as they write them, o_proj casts its input (the attention output) itself, down_proj takes rows the
  SiLU-and-mul casts, and o_proj and down_proj give split-K partials (their sum is the next norm's read). Each takes
  the Triton kernel up to TRITON_MAX_ROWS rows and cuBLASLt above; the casts in the norms are the norm rows' part.

The inputs of qkv and gate_up are written by a layer's two residual-add RMSNorms. Three more rows time those two
norms a layer: writing bf16 rows (what bf16 pays), then casting them with `quantize_rows`, or casting the rows as
they are written (`fused_add_rmsnorm_fp8`, the engine's way), against the floor of the bytes each moves.

The tiles section times the Triton fp8 kernel alone at each projection's shape, a few rows to 64, over a grid of
tile shapes, K splits, warps and pipeline stages (`Tiles`), against the weight-streaming floor and beside the bf16
streaming kernel (`linear_partials`) at the same shape: the row `choose_tiles` marks is the engine's cut, and the
best row of each case says whether that rule is still the fastest there. o_proj and down_proj run as split-K partials,
qkv and gate_up as one product over cuts of one K slice, as the engine runs each.

The casts section times the kernels that write a layer's rows, one launch at a time at 32 and 1024 rows: the
residual-add RMSNorm over the split-K partials the engine hands it (as many as `choose_tiles` splits o_proj and
down_proj into; one bf16 product where cuBLASLt takes the rows), writing bf16 rows or casting them, at 4, 8 and 16
warps a row (the engine's marked); the SiLU-and-mul, writing bf16 rows or casting them; and `quantize_rows` of the
attention output. Each against the floor of the bytes it moves.

Floors, per layer: weight streaming = the weights' bytes (2 a weight in bf16, 1 in fp8) over the HBM bandwidth (a
large device copy, bytes read plus written); compute = 2·rows·N·K over the matmul rate measured for that dtype (a
square bf16 product, a square cuBLASLt fp8 product). The floor is the larger of the two.

    PYTHONPATH=. python benchmarks/fp8.py --out DIR            # GPU (Hopper): about three minutes on an H100
    PYTHONPATH=. python benchmarks/fp8.py --out DIR --sections casts   # the row-writing kernels alone
    PYTHONPATH=. python benchmarks/fp8.py --smoke --out DIR    # anywhere: tiny shapes, eager, products checked
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from diffulex_kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from diffulex_kernels.fp8 import (  # noqa: E402
    FP8, Tiles, choose_tiles, fp8_matmul, fp8_matmul_partials, fp8_rows_partials, pipeline_bytes, quantize_rows,
    quantize_rows_reference, scaled_mm,
)
from diffulex_backend.layers.fp8_linear import Fp8Linear  # noqa: E402
from diffulex_backend.layers.fused_forward import Fp8Rows, _project, _project_partials  # noqa: E402
from diffulex_kernels.linear import linear_partials  # noqa: E402
from diffulex_kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_fp8, norm_warps  # noqa: E402
from forward import device_ms, fp8_matmul_rate, graph_replay_ms, synchronize, wall_ms  # noqa: E402
from result_table import ResultTable  # noqa: E402

# (name, out features N, in features K) of one LLaDA-8B layer.
LLADA_8B = [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
SMOKE = [("qkv", 96, 64), ("o", 64, 64), ("gate_up", 128, 64), ("down", 64, 128)]
LAYERS = 4  # 0.8 GB of fp8 weights, 1.6 GB of bf16: far past the L2 cache
WAYS = ("bf16", "scaled_mm", "scaled_mm + torch cast", "scaled_mm + fused cast", "triton", "triton + fused cast",
        "triton W8A16", "the engine's")
# The row-parallel projections, which hand split-K partials to the norm after them.
PARTIALS = ("o", "down")
NORM_WAYS = ("norms: bf16 rows", "norms + quantize_rows", "norms casting rows")
FIELDS = ["rows", "way", "us_per_layer", "speedup_vs_bf16", "floor_us", "vs_floor", "weight_tb_per_s", "note"]
TILE_FIELDS = ["projection", "rows", "tiles", "us", "floor_us", "vs_floor", "weight_tb_per_s", "bf16_kernel_us",
               "bf16_kernel_vs_floor", "note"]
CAST_FIELDS = ["rows", "kernel", "writes", "inputs", "num_warps", "us", "floor_us", "vs_floor", "note"]
TILE_ROWS = (32, 64)  # one block and two: a decode step's rows per request
# The grid's cuts whose pipeline fits what an H100 gives a program (227 KB), less room for the epilogue.
SHARED_MEMORY_BYTES = 180 * 1024
TILE_GRID = [Tiles(block_n, block_k, split, warps, stages)
             for block_n in (32, 64, 128) for block_k in (128, 256) for split in (1, 2, 4, 8)
             for warps in (4, 8) for stages in (3, 4, 5)]


def torch_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token cast as separate torch ops: what the fused cast replaces."""
    scale = x.abs().amax(-1, keepdim=True).float() / 448.0
    return (x.float() / scale).clamp(-448, 448).to(FP8), scale[:, 0]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(-1, keepdim=True) / 448.0
    return (w.float() / scale).to(FP8), scale


def layer_fn(way: str, x: torch.Tensor, names: list[str], layers_bf16, layers_fp8, pre_cast):
    """One call runs every layer's four products the given way; returns their outputs."""
    modules = [[Fp8Linear(wq, ws, None) for wq, ws in layer] for layer in layers_fp8]
    # The fused forward's own products: o_proj takes the attention output and casts it, the others take rows that
    # the kernels writing them cast (here beforehand, once).
    rows = {k: Fp8Rows(*pre_cast[k], torch.bfloat16) for k in pre_cast}

    def run():
        outs = []
        for bf16, fp8, fp8_modules in zip(layers_bf16, layers_fp8, modules):
            for (name, w, (wq, ws), module) in zip(names, bf16, fp8, fp8_modules):
                k = w.shape[1]
                xk = x[k]
                if way == "the engine's":
                    if name in PARTIALS:
                        outs.append(_project_partials(module, xk if name == "o" else rows[k]))
                    else:
                        outs.append(_project(module, rows[k]))
                    continue
                if way == "bf16":
                    outs.append(F.linear(xk, w))
                    continue
                if way == "triton W8A16":
                    outs.append(fp8_matmul(xk, None, wq, ws, None, torch.bfloat16))
                    continue
                if way in ("scaled_mm", "triton"):
                    xq, xs = pre_cast[k]
                elif way == "scaled_mm + torch cast":
                    xq, xs = torch_cast(xk)
                else:
                    xq, xs = quantize_rows(xk)
                product = scaled_mm if way.startswith("scaled_mm") else fp8_matmul
                outs.append(product(xq, xs, wq, ws, None, torch.bfloat16))
        return outs
    return run


def norms_fn(way: str, product: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, layers: int):
    """A layer's two residual-add RMSNorms (before gate_up, before the next qkv), `layers` times."""
    def run():
        outs = []
        for _ in range(2 * layers):
            if way == "norms casting rows":
                outs.append(fused_add_rmsnorm_fp8(product, residual, weight, 1e-6))
                continue
            rows, _ = fused_add_rmsnorm(product, residual, weight, 1e-6)
            outs.append(quantize_rows(rows) if way == "norms + quantize_rows" else rows)
        return outs
    return run


def norm_bytes(way: str, rows: int, hidden: int) -> int:
    """HBM bytes of one norm: the product and the residual read, the residual and the rows written (bf16, or fp8
    and a scale a row), plus quantize_rows' read of the bf16 rows and write of the fp8 ones."""
    moved = rows * hidden * (2 + 2 + 2) + (rows * (hidden + 4) if way == "norms casting rows" else rows * hidden * 2)
    if way == "norms + quantize_rows":
        moved += rows * hidden * 2 + rows * (hidden + 4)
    return moved


def measure_ceilings(device: torch.device, smoke: bool) -> tuple[float, float, float]:
    """(HBM bytes/s read + written, bf16 flop/s, fp8 flop/s)."""
    if smoke:
        return float("nan"), float("nan"), float("nan")
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    m = 8192
    a, b = (torch.randn(m, m, device=device).to(torch.bfloat16) for _ in range(2))
    # An idle GPU starts at low clocks: keep it busy a while first.
    warm_until = time.perf_counter() + 2.0
    while time.perf_counter() < warm_until:
        a @ b
        synchronize(device)
    copy_ms = device_ms(lambda: dst.copy_(src), device, reps=10)
    bf16_ms = device_ms(lambda: a @ b, device, reps=10)
    fp8_rate = fp8_matmul_rate(a, b, device, reps=10)
    del src, dst
    return 2 * 2 * n / (copy_ms * 1e-3), 2 * m**3 / (bf16_ms * 1e-3), fp8_rate


def check_products(name, rows, layers_bf16, layers_fp8, x, device) -> None:
    """The smoke run's check: each fp8 way against the bf16 product of the dequantized weights, on the same
    activations. The products given torch-cast activations are held tight; with the fused cast, under the
    interpreter, the cast rounds some values wrongly (tests/kernels/test_fp8_kernels.py), so only on the GPU."""
    for w, (wq, ws) in zip(layers_bf16[0], layers_fp8[0]):
        xk = x[w.shape[1]]
        want = F.linear(xk.float(), wq.float() * ws)
        xq, xs = quantize_rows_reference(xk)
        got = fp8_matmul(xq, xs, wq, ws, None, torch.float32)
        exact = (xq.float() * xs[:, None]) @ (wq.float() * ws).T
        # float32 sums under the interpreter; Hopper's fp8 tensor cores add at reduced precision (kernels/fp8.py).
        sum_tolerance = 1e-5 if device.type == "cpu" else 2**-12
        assert ((got - exact).norm() / exact.norm()) < sum_tolerance, f"{name} {rows} rows: triton fp8 product"
        assert ((got - want).norm() / want.norm()) < 2**-4, f"{name} {rows} rows: activation cast error"
        got = fp8_matmul(xk, None, wq, ws, None, torch.float32)  # weight-only: the bf16 activations themselves
        assert ((got - want).norm() / want.norm()) < 1e-5, f"{name} {rows} rows: triton W8A16 product"
        if device.type == "cuda":
            for product in (scaled_mm, fp8_matmul):
                got = product(*quantize_rows(xk), wq, ws, None, torch.float32)
                assert ((got - want).norm() / want.norm()) < 2**-4, f"{name} {rows} rows: {product.__name__}"


def tiles_section(shapes, layers_fp8, layers_bf16, bandwidth: float, device, smoke: bool, out: pathlib.Path):
    """The Triton fp8 kernel at every shape and row count over TILE_GRID (the engine's cut among them), each as the
    engine would run it: partial sums, LAYERS weights in turn, replayed from a CUDA graph. Every cut is a row; the
    engine's and the fastest are marked."""
    table = ResultTable("fp8-tiles", TILE_FIELDS, script="fp8")
    grid = TILE_GRID[:2] if smoke else TILE_GRID
    for rows in (4,) if smoke else TILE_ROWS:
        for index, (name, n, k) in enumerate(shapes):
            x_q, x_scale = quantize_rows_reference(torch.randn(rows, k, device=device).to(torch.bfloat16))
            x = torch.randn(rows, k, device=device).to(torch.bfloat16)
            weights = [layer[index] for layer in layers_fp8]
            floor_us = 1e6 * n * k / bandwidth
            bf16_fn = lambda: [linear_partials(x, layer[index]) for layer in layers_bf16]  # noqa: E731
            bf16_us = 1e3 * (wall_ms(bf16_fn, device) if smoke else graph_replay_ms(bf16_fn, device, reps=20)) / len(
                layers_bf16)
            # qkv and gate_up run as one product (`fp8_matmul`: their outputs feed no norm that adds partials).
            partials = name in PARTIALS
            engine_cut = choose_tiles(rows, n, k) if partials else choose_tiles(rows, n, k)._replace(split_k=1)
            results = []
            cuts = [t for t in grid if pipeline_bytes(t, rows) <= SHARED_MEMORY_BYTES and (partials or t.split_k == 1)]
            for tiles in dict.fromkeys([engine_cut] + cuts):
                if partials:
                    fn = lambda: [fp8_matmul_partials(x_q, x_scale, w, s, tiles) for w, s in weights]  # noqa: E731
                else:
                    fn = lambda: [fp8_matmul(x_q, x_scale, w, s, None, torch.bfloat16, tiles)  # noqa: E731
                                  for w, s in weights]
                try:
                    total_ms = wall_ms(fn, device) if smoke else graph_replay_ms(fn, device, reps=20)
                except Exception as error:  # noqa: BLE001 (a cut the compiler refuses: out of resources)
                    print(f"{name} {rows} rows {tiles}: {type(error).__name__}", flush=True)
                    continue
                results.append((1e3 * total_ms / len(weights), tiles))
            best = min(results, key=lambda r: r[0])[1] if results else None
            for us, tiles in results:
                note = " ".join(word for word, yes in (("choose_tiles", tiles == engine_cut), ("best", tiles == best))
                                if yes)
                table.add(projection=name, rows=rows, tiles=" ".join(f"{f}={v}" for f, v in tiles._asdict().items()),
                          us=us, floor_us=floor_us, vs_floor=us / floor_us, weight_tb_per_s=n * k / (us * 1e-6) / 1e12,
                          bf16_kernel_us=bf16_us, bf16_kernel_vs_floor=bf16_us / (2 * floor_us), note=note)
    table.write(out, None)


def casts_section(shapes, layer_fp8, bandwidth: float, device, smoke: bool, out: pathlib.Path):
    """The kernels that write a layer's rows, each launch alone (module note), replayed 50 times from a CUDA graph.
    `layer_fp8`: one layer's fp8 weights, whose row-parallel products give the norm its partials."""
    table = ResultTable("fp8-casts", CAST_FIELDS, script="fp8")
    weights = {name: w for (name, _, _), w in zip(shapes, layer_fp8)}
    sizes = dict((name, (n, k)) for name, n, k in shapes)
    hidden, intermediate = sizes["o"][0], sizes["down"][1]
    reps = 2 if smoke else 50

    def time_us(fn) -> float:
        many = lambda: [fn() for _ in range(reps)]  # noqa: E731
        return 1e3 * (wall_ms(many, device) if smoke else graph_replay_ms(many, device, reps=5)) / reps

    for rows in (4,) if smoke else (32, 1024):
        residual = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
        weight = torch.rand(hidden, device=device).to(torch.bfloat16) + 0.5
        # What o_proj and down_proj hand the norm at these rows, as the engine takes their products: the Triton
        # kernel's float32 split-K partials, or cuBLASLt's one bf16 product. One input per distinct form.
        inputs = {}
        for name in PARTIALS:
            x_q, x_scale = quantize_rows_reference(torch.randn(rows, sizes[name][1], device=device).to(torch.bfloat16))
            partials = fp8_rows_partials(x_q, x_scale, *weights[name], torch.bfloat16)
            inputs.setdefault((partials.shape[0], partials.dtype), partials)
        for (split, _), partials in inputs.items():
            read = partials.numel() * partials.element_size() + 2 * rows * hidden  # partials, residual
            for writes, fp8 in (("bf16", False), ("fp8", True)):
                moved = read + 2 * rows * hidden + (rows * (hidden + 4) if fp8 else 2 * rows * hidden)
                engine = norm_warps(hidden, fp8, rows)
                norm = fused_add_rmsnorm_fp8 if fp8 else fused_add_rmsnorm
                for warps in (4, 8, 16):
                    us = time_us(lambda: norm(partials, residual, weight, 1e-6, num_warps=warps))
                    floor_us = 1e6 * moved / bandwidth
                    table.add(rows=rows, kernel="residual-add RMSNorm", writes=writes,
                              inputs=f"{split} {'float32 partials' if partials.dtype == torch.float32 else 'bf16'}",
                              num_warps=warps, us=us, floor_us=floor_us, vs_floor=us / floor_us,
                              note="the engine's" if warps == engine else "")
        gate_up = torch.randn(rows, 2 * intermediate, device=device).to(torch.bfloat16)
        attention_out = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
        for kernel, writes, fn, moved in (
                ("SiLU-and-mul", "bf16", lambda: silu_and_mul(gate_up), 6 * rows * intermediate),
                ("SiLU-and-mul", "fp8", lambda: silu_and_mul_fp8(gate_up), rows * (5 * intermediate + 4)),
                ("quantize_rows", "fp8", lambda: quantize_rows(attention_out), rows * (3 * hidden + 4))):
            us = time_us(fn)
            floor_us = 1e6 * moved / bandwidth
            table.add(rows=rows, kernel=kernel, writes=writes, inputs="bf16", num_warps="", us=us, floor_us=floor_us,
                      vs_floor=us / floor_us, note="the engine's")
    table.write(out, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, eager, on any device")
    parser.add_argument("--sections", default="ways,tiles,casts", help="ways (every way a layer's products run), "
                        "tiles (the Triton kernel's cuts), casts (the kernels that write the rows), comma-separated")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    shapes, row_counts, layers = (SMOKE, (4, 32), 2) if args.smoke else (LLADA_8B, (32, 1024), LAYERS)
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth, bf16_rate, fp8_rate = measure_ceilings(device, args.smoke)
    layers_bf16 = [[torch.randn(n, k, device=device).to(torch.bfloat16) * k**-0.5 for _, n, k in shapes]
                   for _ in range(layers)]
    layers_fp8 = [[quantize_weight(w) for w in layer] for layer in layers_bf16]
    params = sum(n * k for _, n, k in shapes)
    table = ResultTable("fp8", FIELDS)
    on_gpu = device.type == "cuda"
    if "tiles" in sections:
        tiles_section(shapes, layers_fp8, layers_bf16, bandwidth, device, args.smoke, args.out)
    if "casts" in sections:
        casts_section(shapes, layers_fp8[0], bandwidth, device, args.smoke, args.out)
    for rows in row_counts if "ways" in sections else ():
        x = {k: torch.randn(rows, k, device=device).to(torch.bfloat16) for k in {k for _, _, k in shapes}}
        pre_cast = {k: quantize_rows_reference(v) for k, v in x.items()}
        if args.smoke:
            check_products("llada-8b-shaped", rows, layers_bf16, layers_fp8, x, device)
        flops = 2 * rows * params
        times = {}
        for way in WAYS:
            if way.startswith("scaled_mm") and not on_gpu:
                continue  # cuBLASLt only on the GPU
            fn = layer_fn(way, x, [name for name, _, _ in shapes], layers_bf16, layers_fp8, pre_cast)
            total_ms = graph_replay_ms(fn, device, reps=20) if on_gpu and not args.smoke else wall_ms(fn, device)
            times[way] = us = 1e3 * total_ms / layers
            weight_bytes = params * (2 if way == "bf16" else 1)
            floor_us = 1e6 * max(weight_bytes / bandwidth, flops / (bf16_rate if way == "bf16" else fp8_rate))
            note = "the engine's way" if way == "the engine's" else ""
            table.add(rows=rows, way=way, us_per_layer=us, speedup_vs_bf16=times["bf16"] / us, floor_us=floor_us,
                      vs_floor=us / floor_us, weight_tb_per_s=weight_bytes / (us * 1e-6) / 1e12, note=note)
        hidden = shapes[0][2]
        product, residual = (torch.randn(rows, hidden, device=device).to(torch.bfloat16) for _ in range(2))
        norm_weight = torch.rand(hidden, device=device).to(torch.bfloat16) + 0.5
        for way in NORM_WAYS:
            fn = norms_fn(way, product, residual, norm_weight, layers)
            total_ms = graph_replay_ms(fn, device, reps=20) if on_gpu and not args.smoke else wall_ms(fn, device)
            times[way] = us = 1e3 * total_ms / layers
            floor_us = 1e6 * 2 * norm_bytes(way, rows, hidden) / bandwidth
            table.add(rows=rows, way=way, us_per_layer=us, speedup_vs_bf16=times[NORM_WAYS[0]] / us,
                      floor_us=floor_us, vs_floor=us / floor_us, weight_tb_per_s="",
                      note="the engine's way" if way == NORM_WAYS[2] else "")
    table.write(args.out, None)
    summary = (f"HBM copy bandwidth {bandwidth / 1e12:.3g} TB/s (read + write); bf16 matmul {bf16_rate / 1e12:.3g} "
               f"TFLOP/s; fp8 matmul (cuBLASLt) {fp8_rate / 1e12:.3g} TFLOP/s; {layers} layers of "
               f"{'tiny' if args.smoke else 'LLaDA-8B'} projections ({params:,} weights a layer); device: "
               f"{torch.cuda.get_device_name(device) if on_gpu else 'cpu (interpreter)'}")
    md = args.out / "fp8.md"
    md.write_text(md.read_text() + "\n" + summary + "\n")
    print(summary)
    print(f"wrote {args.out / 'fp8.csv'} and {md}")


if __name__ == "__main__":
    main()
