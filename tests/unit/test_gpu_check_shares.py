"""tools/gpu_check.py shares its sections out over the GPUs a machine has: every section runs once, on one GPU, in
the table's order there, and the longest shares balance."""
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("num_gpus", [0, 1, 2, 3, 4, 8])
def test_every_section_runs_once_on_one_gpu_in_the_table_s_order(gpu_check, num_gpus):
    sections = list(gpu_check.SECTIONS)
    shares = gpu_check.share_out(sections, num_gpus)
    assert len(shares) == max(1, min(num_gpus, len(sections)))
    assert sorted(s.name for share in shares for s in share) == sorted(s.name for s in sections)
    for share in shares:
        assert share == sorted(share, key=sections.index)
    if num_gpus <= 1:
        assert shares == [sections]


def test_two_gpus_run_the_server_suites_beside_everything_else(gpu_check):
    # The server and client suites take about as long as the other three sections together.
    shares = gpu_check.share_out(list(gpu_check.SECTIONS), 2)
    names = sorted([[s.name for s in share] for share in shares], key=len)
    assert names[0] == ["served: server and client suites, on the GPU"]
    assert len(names[1]) == 3


def test_a_share_never_waits_for_another_longer_than_its_longest_section(gpu_check):
    sections = [gpu_check.Section(f"s{i}", (), seconds=seconds) for i, seconds in enumerate((50, 40, 30, 30, 20, 10))]
    for num_gpus in (2, 3):
        loads = [sum(s.seconds for s in share) for share in gpu_check.share_out(sections, num_gpus)]
        assert max(loads) - min(loads) <= max(s.seconds for s in sections)
