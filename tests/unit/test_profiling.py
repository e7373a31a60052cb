"""Profiling on demand: a request's profile_steps records a trace of the engine's next steps into profile_dir, one
recording at a time, and is refused by name where no profile_dir was given."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.refusal import Refusal
from engine_driver import run_requests, tiny_engine

STEP_RANGES = ("schedule", "forward", "sample", "accept")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def traces(folder: Path) -> list[Path]:
    return sorted(folder.glob("diffulex-steps-*.json"))


def range_counts(trace: Path) -> dict[str, int]:
    """How many times each step range appears in a Chrome trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = [e["name"] for e in events if e.get("ph") == "X"]
    return {name: names.count(name) for name in STEP_RANGES}


@pytest.fixture(scope="module")
def engine(llada_checkpoint, tmp_path_factory):
    return tiny_engine(llada_checkpoint, profile_dir=str(tmp_path_factory.mktemp("profiles")))


def test_profile_steps_records_that_many_steps_and_serves_the_same_tokens(engine, llada_checkpoint):
    folder = Path(engine.config.profile_dir)
    before = traces(folder)
    profiled = run_requests(engine, PROMPTS, [SamplingParams(max_tokens=16, profile_steps=3), SamplingParams(max_tokens=16)])
    plain = run_requests(tiny_engine(llada_checkpoint), PROMPTS, SamplingParams(max_tokens=16))
    assert [s.token_ids for s in profiled] == [s.token_ids for s in plain]
    assert profiled[0].nfe > 3  # the recording stopped at its count, not with the requests
    new = [t for t in traces(folder) if t not in before]
    assert len(new) == 1
    assert range_counts(new[0]) == {name: 3 for name in STEP_RANGES}


def test_a_recording_ends_when_no_request_is_left(engine):
    folder = Path(engine.config.profile_dir)
    before = traces(folder)
    [stream] = run_requests(engine, PROMPTS[:1], SamplingParams(max_tokens=8, profile_steps=1000))
    [trace] = [t for t in traces(folder) if t not in before]
    assert range_counts(trace) == {name: stream.nfe for name in STEP_RANGES}


def test_a_request_asking_during_a_recording_is_served_and_starts_none(engine):
    folder = Path(engine.config.profile_dir)
    before = traces(folder)
    streams = run_requests(engine, PROMPTS, [SamplingParams(max_tokens=8, profile_steps=2),
                                            SamplingParams(max_tokens=8, profile_steps=5)])
    assert all(s.finish_reason is not None for s in streams)
    [trace] = [t for t in traces(folder) if t not in before]
    assert range_counts(trace) == {name: 2 for name in STEP_RANGES}


def test_recordings_in_one_second_never_share_a_file(engine, monkeypatch):
    # The clock held to one second: two recordings a second apart in wall time could straddle a tick.
    monkeypatch.setattr(time, "strftime", lambda *args: "20261127-120000")
    folder = Path(engine.config.profile_dir)
    before = traces(folder)
    for _ in range(2):
        run_requests(engine, PROMPTS[:1], SamplingParams(max_tokens=4, profile_steps=1))
    new = [t for t in traces(folder) if t not in before]
    assert len(new) == 2
    # The same stamp to the second: the names still differ.
    assert len({re.sub(r"-\d+\.json$", "", t.name) for t in new}) == 1


def test_profile_steps_without_profile_dir_is_refused_by_name(llada_checkpoint):
    engine = tiny_engine(llada_checkpoint)
    with pytest.raises(Refusal) as caught:
        engine.prepare_request([5, 6, 7], SamplingParams(max_tokens=8, profile_steps=4))
    assert str(caught.value) == ("sampling parameter 'profile_steps' is 4, but config field 'profile_dir' is not set: "
                                 "this engine records no traces")
    assert caught.value.field == "profile_steps"


@pytest.mark.parametrize("value", [0, -1, 10**9, 1001, 1.5, "3", True, float("nan")])
def test_bad_profile_steps_are_refused_by_name(value):
    with pytest.raises(Refusal) as caught:
        SamplingParams(profile_steps=value)
    assert str(caught.value) == f"sampling parameter 'profile_steps' must be an integer in [1, 1000] or null, got {value!r}"
    assert caught.value.field == "profile_steps"


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_profile_dir_that_is_no_writable_directory_fails_the_load_by_name(llada_checkpoint, tmp_path, kind):
    path = tmp_path / "nowhere"
    if kind == "a file":
        path.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"config field 'profile_dir' must be a writable directory or null, "
                                                   f"got {str(path)!r}")):
        tiny_engine(llada_checkpoint, profile_dir=str(path))


@pytest.fixture
def teardown_unset(monkeypatch):
    """TEARDOWN_CUPTI absent for the test and as it was after it (set first, so that monkeypatch restores it)."""
    monkeypatch.setenv("TEARDOWN_CUPTI", "unset by the test")
    monkeypatch.delenv("TEARDOWN_CUPTI")


@pytest.mark.parametrize("cuda, tears_down", [("13.0", True), ("12.6", True), ("12.4", False), (None, False)])
def test_a_cuda_recording_detaches_the_profiler_where_the_cuda_build_allows(teardown_unset, monkeypatch, cuda,
                                                                            tears_down):
    """Kineto keeps CUPTI attached after a recording unless TEARDOWN_CUPTI=1, and every later launch pays for it
    (benchmarks/profiler_residue.py measures how much on a GPU). A recording that traces CUDA sets it where torch
    tears CUPTI down with CUDA graphs (CUDA 12.6 on); one that traces the host alone leaves the environment alone."""
    import torch
    from torch.profiler import ProfilerActivity

    from diffulex_backend.profiling import device_profile

    monkeypatch.setattr(torch.version, "cuda", cuda)
    device_profile([ProfilerActivity.CPU])
    assert "TEARDOWN_CUPTI" not in os.environ
    device_profile([ProfilerActivity.CPU, ProfilerActivity.CUDA])
    assert os.environ.get("TEARDOWN_CUPTI") == ("1" if tears_down else None)


def test_a_teardown_setting_the_process_was_started_with_wins(monkeypatch):
    import torch
    from torch.profiler import ProfilerActivity

    from diffulex_backend.profiling import device_profile

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    device_profile([ProfilerActivity.CUDA])
    assert os.environ["TEARDOWN_CUPTI"] == "0"


def test_a_gpu_engine_with_a_profile_dir_sets_the_teardown_when_built(teardown_unset, monkeypatch, tmp_path):
    """The engine's recordings are the ones that must not slow the server after them. A CUDA engine with a
    profile_dir sets the teardown when it is built, before any thread serves a request, rather than from the decoding
    thread at its first recording; its recordings then trace as before (a CPU build of torch drops the CUDA side)."""
    import torch

    from diffulex_backend.profiling import StepProfiler

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    StepProfiler(None, torch.device("cuda"))
    assert "TEARDOWN_CUPTI" not in os.environ  # no profile_dir: no recording can happen
    recorder = StepProfiler(str(tmp_path), torch.device("cuda"))
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    recorder.request(1, "r")
    recorder.before_step()
    recorder.after_step(engine_idle=True)
    assert len(traces(tmp_path)) == 1
