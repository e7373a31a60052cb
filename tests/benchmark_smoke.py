"""Running a benchmark script's --smoke mode the way its smoke tests do: in a fresh interpreter, from this checkout."""
import csv
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_smoke(script: str, out: pathlib.Path, *args: str, cpu: bool = False) -> None:
    """benchmarks/<script> --smoke --out OUT [args]; `cpu` hides any GPU and runs the Triton kernels under the
    interpreter, as CI does. Fails the test with the script's output if it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def csv_rows(path: pathlib.Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
