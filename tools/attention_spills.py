"""What the attention kernel's launches cost a Hopper multiprocessor, read from the compiler without a GPU: for each
dtype and head size, every launch the runner compiles ahead (`launch_variants`), compiled for sm_90a, with its
registers a thread, the bytes it spills to local memory (ptxas -v), the shared memory it asks for, and how many of
its loads from shared memory read a single byte (nvdisasm). Arguments are
specialized as the launch on a GPU specializes them for the engine's tensors (`DIVISIBLE_BY_16`): without that, the
compiler cannot vectorize a load, and the same launch compiles to other registers and spills than on the GPU.

    python tools/attention_spills.py                                  # float32 and bfloat16, every head size
    python tools/attention_spills.py --dtypes float32 --head-dims 128 --extra 128,64,4,2   # and one more tile
    python tools/attention_spills.py --dtypes bfloat16 --head-dims 128 --kv-fp8           # over FP8 rows
    python tools/attention_spills.py --dtypes bfloat16 --head-dims 128 --prior            # going on from a prior

`--extra M,N,WARPS,STAGES` adds a tile of your own (unsplit, cached context) to each dtype and head size.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffulex_kernels.attention import (HEAD_DIMS, AttentionLaunch, _paged_attention_kernel,  # noqa: E402
                                        _precision, fp8_row_constants, launch_variants)
from diffulex_kernels.dtypes import triton_dtype  # noqa: E402

POINTERS = {"q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "prior_out_ptr"}
FLOAT_POINTERS = {"part_acc_ptr", "part_max_ptr", "part_sum_ptr", "k_scale_ptr", "v_scale_ptr", "prior_lse_ptr"}
INT_POINTERS = {"cu_seqlens_q_ptr", "context_lens_ptr", "page_tables_ptr", "block_ids_ptr"}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
NVDISASM = PTXAS.parent / "nvdisasm"
# A load of one byte from shared memory: what an FP8 tile costs when it reaches the tensor cores' operand layout
# as bytes that are not consecutive in memory (attention._widen_e4m3).
BYTE_LOAD = re.compile(r"\bLDS\.[US]8\b")
# What Triton's launch finds divisible by 16 on the engine's tensors, and specializes on: every pointer (allocations,
# and an FP8 cache's scales after whole rows of values), and every stride that is a multiple of the head size. The
# page table's stride, the scales' strides and the counts vary with the batch and the model, and are left general.
DIVISIBLE_BY_16 = POINTERS | FLOAT_POINTERS | INT_POINTERS | {
    "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
    "stride_cache_page", "stride_cache_slot", "stride_cache_head"}


def signature(dtype: torch.dtype, constants: dict) -> dict[str, str]:
    element = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    kinds = {}
    for name in _paged_attention_kernel.arg_names:
        if name in constants:
            kinds[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr") and constants["KV_FP8"]:
            kinds[name] = "*fp8e4nv"  # FP8 rows' values (kv_store.fp8_rows)
        elif name in POINTERS:
            kinds[name] = f"*{element}"
        elif name in FLOAT_POINTERS:
            kinds[name] = "*fp32"
        elif name in INT_POINTERS:
            kinds[name] = "*i32"
        else:
            kinds[name] = "fp32" if name == "scale_log2" else "i32"
    return kinds


def compile_one(dtype: torch.dtype, head_dim: int, launch: AttentionLaunch, work: Path, kv_fp8: bool = False,
                prior: bool = False) -> str:
    """One launch's row. With `prior`, the launch that goes on from another kernel's attention over the context
    (flash-attn's): no cache, the prior's output and lse loaded first."""
    dot = triton_dtype(dtype)
    constants = dict(GROUP=1, HEAD_DIM=head_dim, PAGE_SIZE=32, HAS_CACHE=not prior, SPLIT=launch.num_splits > 1,
                     BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, DOT_DTYPE=dot, HAS_WINDOW=False,
                     **fp8_row_constants(dtype, dot, launch, kv_fp8, on_gpu=True),
                     PRECISION=_precision(torch.empty(0, dtype=dtype)), HAS_PRIOR=prior, USE_PDL=False)
    names = _paged_attention_kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE_BY_16}
    source = triton.compiler.ASTSource(fn=_paged_attention_kernel, signature=signature(dtype, constants),
                                       constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    ptx = work / "kernel.ptx"
    ptx.write_text(kernel.asm["ptx"])
    report = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", "-o", str(work / "kernel.cubin"), str(ptx)],
                            capture_output=True, text=True).stderr
    sass = subprocess.run([str(NVDISASM), "-c", str(work / "kernel.cubin")], capture_output=True, text=True).stdout
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    over = " over FP8 rows" if kv_fp8 else " after a prior" if prior else ""
    return (f"| {dtype}{over} | {head_dim} | {launch.block_m} x {launch.block_n}, {launch.num_warps} warps, "
            f"{launch.num_stages} stages, {launch.num_splits} split(s) | {registers.group(1) if registers else '?'} | "
            f"{' / '.join(spills.groups()) if spills else '?'} | {kernel.metadata.shared} | "
            f"{len(BYTE_LOAD.findall(sass)) if sass else '?'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--extra", help="M,N,WARPS,STAGES: one more tile for every dtype and head size")
    parser.add_argument("--kv-fp8", action="store_true", help="the launches over a cache of FP8 rows")
    parser.add_argument("--prior", action="store_true",
                        help="the unsplit launches that go on from a prior over the context (flash-attn's)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="attention-spills-"))
    print("| dtype | head size | launch | registers | spill stores / loads, bytes | shared bytes | byte loads from "
          "shared memory |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            for head_dim in (int(d) for d in args.head_dims.split(",")):
                launches = list(launch_variants(head_dim, torch.empty(0, dtype=dtype).element_size()))
                if args.extra:
                    m, n, warps, stages = (int(x) for x in args.extra.split(","))
                    launches.append(AttentionLaunch(m, n, 1, warps, stages))
                if args.prior:
                    launches = [launch for launch in launches if launch.num_splits == 1]
                for launch in launches:
                    print(compile_one(dtype, head_dim, launch, Path(work), args.kv_fp8, args.prior), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
