"""perf_analyzer over gRPC streaming against the real server, with the shipped input data, and the report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from served_model import url_for

from diffulex_client import DiffulexClient
from diffulex_client.perf import sweep
from diffulex_client.perf.report import format_table, summarize
from diffulex_client.perf.sweep import run_perf_analyzer

PERF_DATA = Path(__file__).resolve().parents[2] / "client" / "perf"
INPUT_FILES = sorted(PERF_DATA.glob("*.json"))
MODEL_INPUTS = {"text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_num_output_tokens"}


def entries(path: Path) -> list[dict]:
    return json.loads(path.read_text())["data"]


def max_tokens(entry: dict) -> int:
    return json.loads(entry["sampling_parameters"][0])["max_tokens"]


def test_input_data_files_cover_three_prompt_sizes_streamed_and_not():
    assert [path.name for path in INPUT_FILES] == [
        f"{size}_{kind}.json" for size in ("long", "medium", "short") for kind in ("non_streaming", "streaming")]
    for path in INPUT_FILES:
        for entry in entries(path):
            assert set(entry) == MODEL_INPUTS
            assert entry["stream"] == [not path.stem.endswith("non_streaming")]
            assert entry["return_num_output_tokens"] == [True]


@pytest.mark.parametrize("size", ["short", "medium", "long"])
def test_input_data_prompts_fit_the_demo_context(server, size):
    client = DiffulexClient(url_for(server, "grpc"), "grpc")
    for entry in entries(PERF_DATA / f"{size}_streaming.json"):
        prompt_tokens = client.generate(entry["text_input"][0], max_tokens=1).num_input_tokens
        assert prompt_tokens + max_tokens(entry) <= 512  # the demo model's max_model_len


def test_perf_analyzer_streams_every_request_to_its_last_block(server, tmp_path):
    input_data = PERF_DATA / "short_streaming.json"
    expected_tokens = max_tokens(entries(input_data)[0])  # ignore_eos: every request runs to max_tokens
    for concurrency in (1, 4):
        export = tmp_path / f"profile_{concurrency}.json"
        # Count windows of `concurrency` requests; a loose stability bound ends after three windows.
        result = run_perf_analyzer(server.grpc_url, "diffulex", input_data, concurrency, concurrency, export,
                                   stability_percentage=1000, max_trials=3)
        assert result.returncode == 0, result.stdout + result.stderr
        (experiment,) = json.loads(export.read_text())["experiments"]
        assert experiment["experiment"] == {"mode": "concurrency", "value": concurrency}
        requests = experiment["requests"]
        assert len(requests) >= 3 * concurrency
        for request in requests:
            responses = request["response_outputs"]
            assert len(request["response_timestamps"]) == len(responses) > 1  # one per committed block
            assert responses[-1]["num_output_tokens"] == expected_tokens

        summary = summarize(experiment)
        assert (summary.concurrency, summary.num_requests) == (concurrency, len(requests))
        assert summary.output_tokens_per_s == pytest.approx(summary.requests_per_s * expected_tokens)
        assert summary.ttfr_p50_ms <= summary.latency_p50_ms
        assert format_table([summary]).splitlines()[2].split()[:2] == [str(concurrency), str(len(requests))]


def test_sweep_prints_the_finished_levels_and_fails_when_a_level_fails(server, tmp_path, monkeypatch, capsys):
    def fail_at_concurrency_2(url, model, input_data, concurrency, *args):
        if concurrency == 2:
            return subprocess.CompletedProcess([], 99, "", "the level-2 run broke")
        return run_perf_analyzer(url, model, input_data, concurrency, *args)

    monkeypatch.setattr(sweep, "run_perf_analyzer", fail_at_concurrency_2)
    status = sweep.main(["--url", server.grpc_url, "--input-data", str(PERF_DATA / "short_streaming.json"),
                         "--concurrency", "1", "2", "4", "--requests-per-window", "1",
                         "--stability-percentage", "1000", "--max-trials", "3", "--output-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 1
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["concurrency"])
    assert [line.split()[0] for line in lines[header + 2:] if line.strip()] == ["1"]  # level 4 never ran
    assert "perf_analyzer failed at concurrency 2 (exit 99)" in err and "the level-2 run broke" in err
    assert sorted(path.name for path in tmp_path.glob("profile_*.json")) == ["profile_concurrency_1.json"]


# A stand-in for perf_analyzer 2.51 that exits 0 with its export cut where its 64 KiB write buffer last flushed, as
# the real one does when it reads a NaN out of an output a response left out (sweep.export_is_whole), for its first
# BROKEN runs, and exports whole after that; each run appends a line to RUNS.
FAKE_PERF_ANALYZER = """#!{python}
import json, pathlib, sys
runs = pathlib.Path({runs!r})
runs.write_text(runs.read_text() + "run\\n" if runs.exists() else "run\\n")
export = pathlib.Path(sys.argv[sys.argv.index("--profile-export-file") + 1])
whole = json.dumps({{"experiments": [{{"requests": [{{"timestamp": 1795787095268554170 + i}} for i in range(4000)]}}]}})
broken = len(runs.read_text().splitlines()) <= {broken}
export.write_text(whole[:65536] if broken else whole)
print("Concurrency: 1, throughput: 1 infer/sec, latency 1 usec")
"""


def fake_perf_analyzer(tmp_path: Path, broken: int) -> Path:
    script = tmp_path / "perf_analyzer"
    script.write_text(FAKE_PERF_ANALYZER.format(python=sys.executable, runs=str(tmp_path / "runs"), broken=broken))
    script.chmod(0o755)
    return script


def test_an_export_cut_at_a_write_buffer_or_empty_is_not_whole(tmp_path):
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"experiments": [{"requests": [{"timestamp": 1795787095268554170}] * 4000}]}))
    assert sweep.export_is_whole(whole)
    cut, empty = tmp_path / "cut.json", tmp_path / "empty.json"
    cut.write_bytes(whole.read_bytes()[:65536])
    empty.write_bytes(b"")
    assert not sweep.export_is_whole(cut) and not sweep.export_is_whole(empty)
    assert not sweep.export_is_whole(tmp_path / "missing.json")


@pytest.mark.parametrize("broken, returncode", [(0, 0), (sweep.EXPORT_ATTEMPTS - 1, 0), (sweep.EXPORT_ATTEMPTS, 1)])
def test_a_run_that_exits_0_with_a_cut_export_is_made_again(tmp_path, monkeypatch, broken, returncode):
    monkeypatch.setattr(sweep, "perf_analyzer_path", lambda: str(fake_perf_analyzer(tmp_path, broken)))
    export = tmp_path / "profile.json"
    result = run_perf_analyzer("localhost:1", "diffulex", PERF_DATA / "short_streaming.json", 1, 1, export, 10, 3)
    runs = (tmp_path / "runs").read_text().splitlines()
    assert (result.returncode, len(runs)) == (returncode, min(broken + 1, sweep.EXPORT_ATTEMPTS))
    if returncode == 0:
        assert sweep.export_is_whole(export)
    else:
        assert f"exited 0 {sweep.EXPORT_ATTEMPTS} times without writing a whole export" in result.stderr


def test_the_environments_perf_analyzer_runs_without_a_library_path():
    """The venv's perf_analyzer finds libcudart.so.12 by itself (tools/wrap_perf_analyzer.py), as a user runs it."""
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}
    done = subprocess.run([sweep.perf_analyzer_path(), "--version"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0 and "Perf Analyzer Version 2.51.0" in done.stderr, done.stderr
