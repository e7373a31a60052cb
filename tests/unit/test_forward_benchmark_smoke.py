"""A smoke run of the forward benchmark: every section end to end on a tiny CPU model, so the script cannot rot
between GPU runs, and the ratios a reader takes from its table are there, finite, and what their names say."""
import csv
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def ratio(row: dict, numerator: str, denominator: str) -> float:
    """The row's `numerator_vs_...` column, checked against the two columns it divides."""
    value = float(row[f"{numerator.removesuffix('_ms')}_vs_{denominator.removesuffix('_ms')}"])
    assert math.isfinite(value) and value > 0
    # Each column is written to 4 significant digits.
    assert value == pytest.approx(float(row[numerator]) / float(row[denominator]), rel=2e-3)
    return value


def test_smoke_run_reports_every_section_with_its_ratios(tmp_path):
    # On the CPU on every machine, as CI runs it: the check section's exact agreement below holds for the float32
    # torch path only.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "forward.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, env=env, capture_output=True, text=True, timeout=600)
    rows = list(csv.DictReader(open(tmp_path / "forward.csv")))
    by_section = {}
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
    assert sorted(r["case"] for r in by_section["forward"]) == ["b1_ctx64", "b2_ctx64"]
    for row in by_section["forward"]:
        for key in ("engine_ms", "engine_step_ms", "plain_ms", "weight_floor_ms", "compute_floor_ms"):
            assert float(row[key]) > 0
        # A floor is a lower bound: no measured forward beats it, on the CPU as on the GPU.
        assert ratio(row, "engine_ms", "weight_floor_ms") > 1
        assert ratio(row, "engine_ms", "compute_floor_ms") > 1
        ratio(row, "engine_ms", "plain_ms")
    assert [r["k"] for r in by_section["decode_fixed_k"]] == ["1", "4"]
    # Exactly k tokens per request per step: tokens/s over the step time gives k * batch back.
    for row in by_section["decode_fixed_k"]:
        per_step = float(row["engine_tokens_per_s"]) * float(row["engine_step_ms"]) * 1e-3
        assert abs(per_step - int(row["k"]) * int(row["batch"])) < 0.05 * per_step
    assert sorted(r["case"] for r in by_section["diffulex"]) == [
        "d2f_buffer4_b1", "d2f_buffer4_b2", "multi_bd_buffer1_b1", "multi_bd_buffer1_b2"]
    # Diffulex's settings, the engine's figures only: no column compares with a figure this run did not measure.
    assert all(float(r["engine_step_ms"]) > 0 and int(r["tokens"]) > 0 for r in by_section["diffulex"])
    assert not [column for column in rows[0] if "reference" in column or "diffulex" in column]
    # On the CPU every path of the check is the float32 torch path, so they must agree exactly.
    assert by_section["check"][0]["note"].count("greedy output equal to the float32 path for 2/2 requests") == 2
    assert "matmul" in by_section["profile"][0]["note"]
    assert (tmp_path / "forward.md").read_text().count("### ") == 5
