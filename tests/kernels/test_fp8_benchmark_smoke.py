"""A smoke run of the FP8 benchmark on the CPU (the Triton kernels under the interpreter), so the script cannot rot
between GPU runs: it checks its own products, and writes a row per row count and way that runs without a GPU (the
products, then the norms that write their inputs), with times that are times and speedups that are bf16's time
over the way's; and the tile table, with the engine's cut at every projection."""
import pytest
from benchmark_smoke import csv_rows, run_smoke


def test_smoke_run_times_each_way_against_bf16_and_marks_the_engines_choice(tmp_path):
    run_smoke("fp8.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "fp8.csv")
    # cuBLASLt's ways need a GPU; the rest run at both row counts.
    products = ("bf16", "triton", "triton + fused cast", "triton W8A16", "the engine's")
    norms = ("norms: bf16 rows", "norms + quantize_rows", "norms casting rows")
    assert [(r["rows"], r["way"]) for r in rows] == [(n, w) for n in ("4", "32") for w in products + norms]
    by_rows = {}
    for row in rows:
        by_rows.setdefault(row["rows"], {})[row["way"]] = row
    for ways in by_rows.values():
        for group in (products, norms):  # each group's speedups are over its first, bf16, way
            base = float(ways[group[0]]["us_per_layer"])
            for way in group:
                us = float(ways[way]["us_per_layer"])
                assert us > 0 and float(ways[way]["speedup_vs_bf16"]) == pytest.approx(base / us, rel=2e-3)
        assert ways["the engine's"]["note"] == "the engine's way"
        assert ways["norms casting rows"]["note"] == "the engine's way"
    markdown = (tmp_path / "fp8.md").read_text()
    assert markdown.startswith("`python benchmarks/fp8.py --smoke --out") and "| rows | way |" in markdown
    assert "device: cpu (interpreter)" in markdown


def test_smoke_run_times_the_engines_tile_cut_at_every_projection(tmp_path):
    run_smoke("fp8.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "fp8-tiles.csv")
    # Each projection has a row per cut: one of them the engine's (choose_tiles), one the fastest (maybe the same).
    for projection in ("qkv", "o", "gate_up", "down"):
        mine = [r for r in rows if r["projection"] == projection]
        assert sum("choose_tiles" in r["note"] for r in mine) == 1
        assert sum("best" in r["note"] for r in mine) == 1
        for row in mine:
            # The smoke run measures no bandwidth, so its floors are NaN, and so is every ratio to them.
            us, floor, vs_floor = float(row["us"]), float(row["floor_us"]), float(row["vs_floor"])
            assert us > 0 and float(row["bf16_kernel_us"]) > 0
            assert vs_floor == pytest.approx(us / floor, rel=2e-3, nan_ok=True)
    assert (tmp_path / "fp8-tiles.md").read_text().startswith("`python benchmarks/fp8.py --smoke --out")


def test_smoke_run_times_the_row_writing_kernels_and_marks_the_engines_launch(tmp_path):
    run_smoke("fp8.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "fp8-casts.csv")
    norms = [r for r in rows if r["kernel"] == "residual-add RMSNorm"]
    # The smoke shapes split o_proj and down_proj alike at 4 rows: one partials count, both writes, three warps.
    assert sorted((r["writes"], r["num_warps"]) for r in norms) == [
        (writes, warps) for writes in ("bf16", "fp8") for warps in ("16", "4", "8")]
    for writes in ("bf16", "fp8"):
        assert sum(r["note"] == "the engine's" for r in norms if r["writes"] == writes) == 1
    others = [(r["kernel"], r["writes"]) for r in rows if r not in norms]
    assert others == [("SiLU-and-mul", "bf16"), ("SiLU-and-mul", "fp8"), ("quantize_rows", "fp8")]
    for row in rows:
        assert float(row["us"]) > 0
        assert float(row["vs_floor"]) == pytest.approx(float(row["us"]) / float(row["floor_us"]), rel=2e-3,
                                                        nan_ok=True)
    assert (tmp_path / "fp8-casts.md").read_text().startswith("`python benchmarks/fp8.py --smoke --out")
