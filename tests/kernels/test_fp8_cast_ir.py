"""The kernels that write fp8 rows keep NaN on a GPU, checked on the CPU: their Triton IR, built for Hopper (sm_90)
without a GPU, holds only NaN-keeping maxima and minima (arith.maximumf / minimumf), never the NaN-dropping ones
(arith.maxnumf / minnumf) that Triton's maximum, minimum and max reduction give by default.

The interpreter cannot show this: it runs maximum and minimum as numpy's, which keep NaN whatever they are told,
and the max reduction as numpy's nanmax, which drops it. A cast that drops NaN turns a NaN row into finite values
at full magnitude on a GPU alone (tests/kernels/test_fp8_kernels.py checks the values there).

The IR is built in a process of its own: the suite interprets kernels on a CPU (tests/conftest.py), and an
interpreted kernel has no IR."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BUILD_IR = r'''
import json, re
import triton.language as tl
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from diffulex_kernels import activation, attention, fp8, kv_store, norm, peer_collectives, rotary


def ttir(fn, signature, constexprs):
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn=fn, signature={**signature, **{name: "constexpr" for name in constexprs}},
                       constexprs=constexprs)
    return str(source.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), context))


KERNELS = {
    "quantize_rows": (fp8._quantize_rows_kernel,
                      dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", K="i32", stride_x="i32",
                           stride_q="i32"),
                      dict(BLOCK=1024, USE_PDL=False)),
    "silu_and_mul_fp8, chunk maxima": (
        activation._silu_and_mul_kernel,
        dict(x_ptr="*bf16", out_ptr="*bf16", amax_ptr="*fp32", stride_x="i32", stride_out="i32", size="i32",
             num_chunks="i32"),
        dict(BLOCK=1024, CHUNK_AMAX=True, USE_PDL=False)),
    "silu_and_mul_fp8, cast": (
        activation._cast_chunks_kernel,
        dict(h_ptr="*bf16", amax_ptr="*fp32", q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_h="i32", stride_q="i32",
             size="i32", num_chunks="i32"),
        dict(BLOCK=1024, CHUNKS=4, USE_PDL=False)),
    "fused_add_rmsnorm_fp8": (
        norm._rmsnorm_kernel,
        dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*fp8e4nv", residual_out_ptr="*bf16",
             scale_ptr="*fp32", stride_partial="i32", stride_x="i32", stride_residual="i32", stride_out="i32",
             stride_residual_out="i32", hidden_size="i32", eps="fp32"),
        dict(NUM_PARTIALS=1, ADD_RESIDUAL=True, BLOCK=4096, USE_PDL=False, FP8_OUT=True, ACT_DTYPE=tl.bfloat16,
             HAS_WEIGHT=True)),
    "the collective ending in the fp8 norm": (
        peer_collectives._one_shot_add_rmsnorm,
        dict(x_ptr="*fp32", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*fp8e4nv", residual_out_ptr="*bf16",
             scale_ptr="*fp32", staging_ptr="*fp32", staging_offsets="*i64", flag_ptrs="*i64", counts_ptr="*i64",
             num_rows="i32", hidden_size="i32", half_size="i32", rank="i32", timeout_ns="i64", eps="fp32"),
        dict(WORLD=2, BLOCK=4096, NUM_PARTIALS=4, FP8_OUT=True, ACT_DTYPE=tl.bfloat16, HAS_WEIGHT=True, TIMED=False,
             USE_PDL=False)),
    "store_kv into fp8 rows": (
        kv_store._store_kv_kernel,
        dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32",
             v_scale_ptr="*fp32", slot_mapping_ptr="*i64", stride_kt="i32", stride_kh="i32", stride_vt="i32",
             stride_vh="i32", stride_cache_slot="i32", stride_cache_head="i32", stride_scale_slot="i32",
             stride_scale_head="i32"),
        dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, FP8=True, USE_PDL=False)),
    "rotate_and_store_kv into fp8 rows, normed and partially rotated": (
        rotary._rotary_kernel,
        dict(x_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", v_ptr="*bf16", k_cache_ptr="*fp8e4nv",
             v_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_mapping_ptr="*i64",
             q_weight_ptr="*bf16", k_weight_ptr="*bf16", eps="fp32", stride_xt="i32", stride_xh="i32",
             stride_cos="i32", stride_sin="i32", stride_vt="i32", stride_vh="i32",
             stride_cache_slot="i32", stride_cache_head="i32", stride_scale_slot="i32", stride_scale_head="i32",
             num_heads="i32", num_q_heads="i32"),
        dict(HALF=32, PASS=64, BLOCK_PASS=64, BLOCK_D=128, NORM=True, BLOCK_H=32, STORE_KV=True, FP8=True,
             KV_HEADS=4, BLOCK_KV=4, USE_PDL=False)),
    "the split-KV merge casting o_proj's rows": (
        attention._merge_splits_kernel,
        dict(part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", out_ptr="*fp8e4nv",
             scale_ptr="*fp32", stride_ot="i32", stride_oh="i32", num_tokens="i32", num_heads="i32",
             num_splits="i32"),
        dict(HEAD_DIM=128, SPLITS=4, BLOCK_H=32, FP8_OUT=True, ACT_DTYPE=tl.bfloat16, USE_PDL=False)),
    "the fp8 gate_up product with SiLU-and-mul in its epilogue": (
        fp8._fp8_matmul_kernel,
        dict(x_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*fp32",
             out_ptr="*bf16", amax_ptr="*fp32", M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32",
             stride_os="i32", stride_om="i32", GROUPS="i32", GROUP_K="i32", K_PER_SPLIT="i32", num_chunks="i32"),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, GROUPED=False, HAS_BIAS=False, X_SCALED=True,
             DOT_DTYPE=tl.float8e4nv, IMPRECISE_ACC=32, GATED=True, USE_PDL=False)),
}
print(json.dumps({name: sorted(set(re.findall(r"arith\.((?:max|min)\w*)", ttir(*args))))
                  for name, args in KERNELS.items()}))
'''


@pytest.fixture(scope="module")
def ops_by_kernel() -> dict[str, list[str]]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # compiled, not interpreted
    built = subprocess.run([sys.executable, "-c", BUILD_IR], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return json.loads(built.stdout.strip().splitlines()[-1])


def test_every_fp8_row_writer_takes_nan_keeping_maxima_and_minima(ops_by_kernel):
    assert len(ops_by_kernel) == 9
    for kernel, ops in ops_by_kernel.items():
        assert "maximumf" in ops, kernel  # the row's largest magnitude is taken here
        assert not {"maxnumf", "minnumf"} & set(ops), f"{kernel} drops NaN: {ops}"
