"""`make gpu-runtime` packs perf_analyzer for a GPU machine without tritonclient's binary: the binary and the
libraries it links that such an image may lack, and `install` puts a perf_analyzer beside the runtime's python that
runs with them alone on its library path."""
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location("pack_gpu_runtime", REPO / "tools" / "pack_gpu_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_packed_perf_analyzer_runs_through_its_wrapper(tmp_path):
    tool = load_tool()
    packed = tool.pack_perf_analyzer(tmp_path / "runtime")
    assert sorted(p.name for p in packed) == sorted(["perf_analyzer", *tool.PERF_ANALYZER_LIBRARIES])
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    wrapper = tool.install_perf_analyzer(tmp_path / "runtime", prefix)
    assert wrapper == prefix / "bin" / "perf_analyzer"
    # No library path of its own: what it links beyond the system comes from the packed folder.
    done = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "Perf Analyzer Version 2.51.0" in done.stdout + done.stderr


def test_a_runtime_packed_without_it_installs_none(tmp_path):
    assert load_tool().install_perf_analyzer(tmp_path / "runtime", tmp_path / "prefix") is None
