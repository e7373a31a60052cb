"""tools/gpu_check.py shares its sections out over the GPUs a machine has: every section runs once, on one GPU, in
the table's order there, and the longest shares balance; a section that needs two GPUs runs after them on the first
two, or, where the machine has one, is written down as not run. A section cut at the time limit says so, with the
tests that had ended by then."""
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
    sections = [section for section in gpu_check.SECTIONS if section.gpus == 1]
    shares = gpu_check.share_out(sections, num_gpus)
    assert len(shares) == max(1, min(num_gpus, len(sections)))
    assert sorted(s.name for share in shares for s in share) == sorted(s.name for s in sections)
    for share in shares:
        assert share == sorted(share, key=sections.index)
    if num_gpus <= 1:
        assert shares == [sections]


def test_two_gpus_pair_the_longest_section_with_the_shortest(gpu_check):
    # The server and client suites take longest and the offline API least; the kernels and the served families
    # together take about as long as those two.
    shares = gpu_check.share_out([section for section in gpu_check.SECTIONS if section.gpus == 1], 2)
    assert sorted([s.name for s in share] for share in shares) == [
        ["offline API", "served: server and client suites, on the GPU"],
        ["served: every family and strategy, KIND_GPU, the shipped repository",
         "kernels, CUDA graphs and the fused forward"],
    ]


def test_a_share_never_waits_for_another_longer_than_its_longest_section(gpu_check):
    sections = [gpu_check.Section(f"s{i}", (), seconds=seconds) for i, seconds in enumerate((50, 40, 30, 30, 20, 10))]
    for num_gpus in (2, 3):
        loads = [sum(s.seconds for s in share) for share in gpu_check.share_out(sections, num_gpus)]
        assert max(loads) - min(loads) <= max(s.seconds for s in sections)


@pytest.fixture
def fake_machine(gpu_check, monkeypatch, tmp_path):
    """gpu_check.main with `gpus` GPUs whose sections pass without running: it returns the exit code, the table
    and each section's (name, GPUs it saw, order of its start)."""
    (tmp_path / "docs").mkdir()
    monkeypatch.setattr(gpu_check, "REPOSITORY_ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "install_runtime", lambda runtime, prefix: Path(sys.executable))
    monkeypatch.setattr(gpu_check, "device_line", lambda python: "a fake GPU")

    def run(gpus: int, failing: str = ""):
        ran = []
        monkeypatch.setattr(gpu_check, "visible_gpus", lambda python: [str(i) for i in range(gpus)])

        def run_section(python, section, log_dir, deadline, gpu=None):
            ran.append((section.name, gpu))
            return gpu_check.Outcome(section, 3, int(section.name == failing), 0, int(section.name == failing), 1.0)

        monkeypatch.setattr(gpu_check, "run_section", run_section)
        code = gpu_check.main(["--out", str(tmp_path / "out"), "--commit", "abc"])
        return code, (tmp_path / "docs" / "gpu-check.md").read_text(), ran
    return run


def test_the_two_gpu_section_runs_last_on_the_first_two_gpus(gpu_check, fake_machine):
    (two_gpus,) = [section for section in gpu_check.SECTIONS if section.gpus == 2]
    code, report, ran = fake_machine(gpus=3)
    assert code == 0 and ran[-1] == (two_gpus.name, "0,1")
    assert {gpu for _, gpu in ran[:-1]} == {"0", "1", "2"}
    assert report.splitlines()[-1].startswith(f"| all | {3 * len(gpu_check.SECTIONS)} | 0 | 0 | pass |")


def test_one_gpu_writes_the_two_gpu_section_down_as_not_run_and_judges_the_rest(gpu_check, fake_machine):
    (two_gpus,) = [section for section in gpu_check.SECTIONS if section.gpus == 2]
    code, report, ran = fake_machine(gpus=1)
    assert code == 0 and two_gpus.name not in [name for name, _ in ran]
    paths = ", ".join(f"`{path}`" for path in two_gpus.paths)
    assert f"| {two_gpus.name} ({paths}) | 0 | 0 | 0 | not run: needs 2 GPUs, " \
           f"1 here | 0 |" in report
    assert "| pass (1 not run) |" in report.splitlines()[-1]
    code, report, _ = fake_machine(gpus=1, failing="offline API")
    assert code == 1 and "| FAIL (1 not run) |" in report.splitlines()[-1]


CUT_LOG = """\
============================= test session starts ==============================
tests/client/test_cli.py::test_generate_prints_the_completion_text[grpc] PASSED [ 87%]
tests/client/test_cli.py::test_stream_prints_the_same_text[http] FAILED  [ 90%]
tests/client/test_cli.py::test_needs_a_gpu SKIPPED (no GPU)             [ 91%]
[gw0] [ 92%] PASSED tests/kernels/test_rotary.py::test_rotary[32]
[gw1] [ 93%] ERROR tests/kernels/test_rotary.py::test_rotary[64]
tests/client/test_cli.py::test_help_documents_the_exit_codes 
FAILED tests/client/test_cli.py::test_stream_prints_the_same_text[http] - AssertionError
cut off at the check's time limit
"""


def test_a_section_cut_at_the_time_limit_counts_the_tests_that_ended_and_says_it_was_cut(gpu_check):
    # The test still running when the section was cut has no outcome; the summary's FAILED line is not a second one.
    assert gpu_check.counts_from_log(CUT_LOG) == (5, 2, 1)
    section = gpu_check.SECTIONS[0]
    cut = gpu_check.Outcome(section, 5, 0, 0, -1, 300.0, cut=True)
    assert not cut.passed and cut.result == "FAIL: cut at the time limit"
    row = gpu_check.table([cut], "abc", "a GPU", 1, 300.0).splitlines()[-2]
    assert row.endswith("| 5 | 0 | 0 | FAIL: cut at the time limit | 300 |")
