"""Profiling on demand: a torch.profiler recording of the next engine steps, and the named ranges a step carries.

With the engine's `profile_dir` set, a request's `profile_steps` N records the next N engine steps into a Chrome
trace JSON in that folder (open it in Perfetto or chrome://tracing). The recording also ends when the engine runs
out of requests, so the file is written once the requests that were decoding have finished. One recording runs at a
time: a request that asks while one is armed or under way is served as usual and starts none (the log says so).

Every step carries the ranges schedule (engine.py), forward, sample and accept (runner.py) and respond
(serving/engine_loop.py), named alike in the trace and, on CUDA, in Nsight Systems. The response thread's respond
trails the decoding thread's step, so the last recorded step's respond falls after the recording.
"""
from __future__ import annotations

import enum
import logging
import os
import time
from pathlib import Path

import torch
from torch._C._profiler import _RecordFunctionFast
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger(__name__)


def step_range(name: str, device: torch.device):
    """A context manager over a named part of one step. torch.profiler shows record-function ranges but not NVTX ones,
    and Nsight Systems shows NVTX ranges but record-function ones only under `emit_nvtx`, so on CUDA a range is both.
    The record function is torch's fast one, the form its compiler emits into generated code: outside a recording it
    costs about 0.3 us, where `torch.profiler.record_function` costs 8 to 9 us, which over a step's ranges would be a
    tenth of the 0.3 ms a batch-1 step may spend outside the forward. NVTX is left out off CUDA, where CPU builds of
    torch have none."""
    return NvtxRange(name) if device.type == "cuda" else _RecordFunctionFast(name)


class NvtxRange:
    """A record-function range inside an NVTX range of the same name."""

    __slots__ = ("name", "record")

    def __init__(self, name: str):
        self.name = name
        self.record = _RecordFunctionFast(name)

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self.name)
        self.record.__enter__()

    def __exit__(self, *exc_info) -> None:
        self.record.__exit__(*exc_info)
        torch.cuda.nvtx.range_pop()


# Torch tears CUPTI down with CUDA graphs in the process from CUDA 12.6 on; before it, a recording after a teardown
# could crash (torch/profiler/profiler.py keeps CUPTI attached there).
TEARDOWN_MIN_CUDA = (12, 6)


def activities_for(device: torch.device) -> list[ProfilerActivity]:
    """What a recording on `device` traces: the host, and CUDA on a GPU."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def tear_down_cupti_after_recordings() -> None:
    """Has every later recording that traces CUDA detach CUPTI when it stops (TEARDOWN_CUPTI=1). Without it the
    profiler keeps CUPTI attached after a recording, and every later launch pays for the attachment, a captured
    forward's replay most, for as long as the process lives (benchmarks/profiler_residue.py measures it; its CSV in
    docs/performance). Kineto reads the variable when a recording stops and when the next one starts, so it is set
    before the first and left set; the engine sets it when it is built, before its serving threads start, so that no
    thread reads the environment while another writes it. Left alone: a value the process was started with
    (TEARDOWN_CUPTI=0 keeps CUPTI attached, as before), and a build without CUDA or with a CUDA older than
    TEARDOWN_MIN_CUDA."""
    cuda = torch.version.cuda
    if cuda is not None and tuple(int(part) for part in cuda.split(".")[:2]) >= TEARDOWN_MIN_CUDA:
        os.environ.setdefault("TEARDOWN_CUPTI", "1")


def device_profile(activities: list[ProfilerActivity], **kwargs) -> profile:
    """A torch.profiler over `activities` that leaves the device as it found it once it stops, where the CUDA build
    allows (tear_down_cupti_after_recordings)."""
    if ProfilerActivity.CUDA in activities:
        tear_down_cupti_after_recordings()
    return profile(activities=activities, **kwargs)


class RecordingState(enum.Enum):
    IDLE = enum.auto()
    ARMED = enum.auto()  # a request asked: the next step starts the recording
    RECORDING = enum.auto()


class StepProfiler:
    """Records the engine's steps when a request asks (profile_steps). Driven by the thread that runs the steps:
    `request` when a request joins, `before_step` and `after_step` around each step."""

    def __init__(self, profile_dir: str | None, device: torch.device):
        self.profile_dir = None if profile_dir is None else Path(profile_dir)
        self.activities = activities_for(device)
        if self.profile_dir is not None and ProfilerActivity.CUDA in self.activities:
            tear_down_cupti_after_recordings()
        self.state = RecordingState.IDLE
        self.num_steps = 0  # asked for by the recording armed or under way
        self.num_recorded = 0
        self.num_recordings = 0  # since the engine was built: part of each file name
        self._profile: profile | None = None

    def request(self, num_steps: int, request_id: str) -> None:
        """Record the next `num_steps` steps, unless a recording is armed or under way already."""
        if self.state is not RecordingState.IDLE:
            logger.info("request %s asks to record %d engine steps while a recording of %d is %s: it starts none",
                        request_id, num_steps, self.num_steps, self.state.name.lower())
            return
        self.state, self.num_steps, self.num_recorded = RecordingState.ARMED, num_steps, 0
        logger.info("request %s: recording the next %d engine steps", request_id, num_steps)

    def before_step(self) -> None:
        if self.state is not RecordingState.ARMED:
            return
        # Every thread's ranges, so that the response thread's `respond` shows beside the decoding thread's step.
        # A recording is one profiler cycle, so accumulating across cycles changes nothing; it keeps torch from
        # warning that events are cleared between cycles.
        self._profile = device_profile(self.activities, acc_events=True,
                                       experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True))
        try:
            self._profile.start()
        except Exception:  # a profiler that cannot start costs the recording, never the step
            logger.exception("starting the step profiler failed; no steps are recorded")
            self.state, self._profile = RecordingState.IDLE, None
            return
        self.state = RecordingState.RECORDING

    def after_step(self, engine_idle: bool) -> None:
        """After a step; `engine_idle`: no request is left, so the recording ends here rather than wait for
        steps that no request asks for."""
        if self.state is not RecordingState.RECORDING:
            return
        self.num_recorded += 1
        if self.num_recorded >= self.num_steps or engine_idle:
            self._finish()

    def close(self) -> None:
        """Write what a recording under way holds; the engine serves no step after this."""
        if self.state is RecordingState.RECORDING:
            self._finish()
        self.state = RecordingState.IDLE

    def _finish(self) -> None:
        self.state, recording, self._profile = RecordingState.IDLE, self._profile, None
        path = self._trace_path()
        try:
            recording.stop()
            recording.export_chrome_trace(str(path))
        except Exception:  # a full disk or a vanished folder costs the trace, never the engine
            logger.exception("writing the step trace %s failed", path)
            return
        logger.info("recorded %d engine steps into %s", self.num_recorded, path)

    def _trace_path(self) -> Path:
        """A file name no recording has taken: the process id keeps apart model instances sharing the folder, the
        count this engine's recordings, and the time those of an earlier process with the same id."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        while True:
            self.num_recordings += 1
            path = self.profile_dir / f"diffulex-steps-{stamp}-pid{os.getpid()}-{self.num_recordings}.json"
            if not path.exists():
                return path
