"""Smoke runs of the kernel and matmul benchmarks: each script runs end to end on a tiny shape, so it cannot rot
between GPU runs, and the ratios a reader takes from its table are there, finite, and what their names say."""
import math

import pytest
from benchmark_smoke import csv_rows, run_smoke

KERNELS = [
    "paged_attention", "paged_attention sweep", "paged_attention key tiles", "store_kv", "sample_and_confidence", "sample_and_confidence sweep",
    "accept_tokens", "rmsnorm", "fused_add_rmsnorm",
]


def test_kernel_benchmark_smoke_run_puts_every_kernel_above_its_floor(tmp_path):
    run_smoke("kernels.py", tmp_path)
    table = (tmp_path / "kernels.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert sorted({row[0].lstrip("| ") for row in rows}) == sorted(KERNELS)
    for row in rows:
        kernel_ms, floor_ms, ratio = float(row[2]), float(row[3]), float(row[4])
        assert math.isfinite(ratio) and ratio == pytest.approx(kernel_ms / floor_ms, rel=0.01, abs=0.01)
        # The floor is a lower bound from the same run's ceilings: no kernel beats it, on the CPU either.
        assert ratio > 1


def test_matmul_benchmark_smoke_run_compares_every_case_with_cublas(tmp_path):
    run_smoke("linear.py", tmp_path)
    rows = csv_rows(tmp_path / "linear.csv")
    assert [row["tokens"] for row in rows] == ["4", "16"]
    for row in rows:
        ratio = float(row["engine_vs_cublas"])
        assert math.isfinite(ratio) and ratio > 0
        assert ratio == pytest.approx(float(row["engine_ms"]) / float(row["cublas_ms"]), rel=0.01)


def test_attention_benchmark_smoke_run_gives_every_backend_a_row_per_case_and_the_kernel_matches_torch(tmp_path):
    run_smoke("attention.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "attention.csv")
    cases = {(row["phase"], row["batch"], row["tokens"], row["context"]) for row in rows}
    # Two prompt lengths and two contexts, batch 1 and 2; blocks over a cache also over its FP8 rows.
    assert len(cases) == 8 and len(rows) == 4 * 4 + 5 * 4
    prefill_backends = {row["backend"] for row in rows if row["phase"] == "prefill"}
    assert prefill_backends == {"triton", "torch_sdpa", "flash_attn_4", "flashinfer"}
    for row in rows:
        floor = max(float(row["compute_floor_ms"]), float(row["memory_floor_ms"]))
        # Under the interpreter flash-attn-4 and FlashInfer cannot run, installed or not; their rows say why.
        if row["backend"] in ("flash_attn_4", "flashinfer"):
            assert math.isnan(float(row["ms"])) and row["note"] == "needs a CUDA device"
            continue
        assert float(row["vs_floor"]) == pytest.approx(float(row["ms"]) / floor, rel=0.01)
        # bf16 under the interpreter: the kernel agrees with torch's attention to its rounding; over FP8 rows, to
        # e4m3's (3 mantissa bits) where there is a cached context.
        assert float(row["rel_err_vs_sdpa"]) < (5e-2 if row["backend"] == "triton_fp8_kv" else 1.5e-2)
    for block in (row for row in rows if row["backend"] == "triton" and row["phase"] == "block"):
        fp8 = next(row for row in rows if row["backend"] == "triton_fp8_kv" and
                   (row["batch"], row["context"]) == (block["batch"], block["context"]))
        assert (float(fp8["memory_floor_ms"]) < float(block["memory_floor_ms"])) == (block["context"] != "0")
