"""The kernel benchmark's smoke mode runs end to end, so the script cannot rot between GPU runs."""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
KERNELS = [
    "paged_attention", "paged_attention sweep", "store_kv", "sample_and_confidence", "sample_and_confidence sweep",
    "accept_tokens", "rmsnorm", "fused_add_rmsnorm",
]


def test_smoke_run_reports_every_kernel_against_its_floor(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kernels.py"), "--smoke", "--out", str(tmp_path)],
        check=True, env=env, capture_output=True, text=True, timeout=300,
    )
    table = (tmp_path / "kernels.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert sorted({row[0].lstrip("| ") for row in rows}) == sorted(KERNELS)
    for row in rows:
        kernel_ms, floor_ms = float(row[2]), float(row[3])
        assert kernel_ms > 0 and floor_ms > 0


def test_matmul_benchmark_smoke_run_checks_and_times_every_case(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "linear.py"), "--smoke", "--out", str(tmp_path)],
        check=True, env=env, capture_output=True, text=True, timeout=300,
    )
    rows = (tmp_path / "linear.csv").read_text().splitlines()
    assert rows[0].split(",")[:3] == ["model", "tokens", "kernel"]
    assert [row.split(",")[1] for row in rows[1:]] == ["4", "16"]
    assert all(float(row.split(",")[4]) > 0 for row in rows[1:])
