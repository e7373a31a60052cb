"""The engine loop's failure paths, with a real engine in this process: what the server cannot be made to do
on demand (a response that cannot be sent, an engine that fails mid-step, an unload with requests open)."""

import os
import threading
import time

import pytest

from triton_server import TEST_SETTINGS

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.resolve import ResolvedRequest
from diffulex_backend.serving.engine_loop import EngineLoop, ErrorKind, FailureCause, LoopState
from diffulex_backend.serving.metrics import ServingMetrics

PARAMS = SamplingParams(max_tokens=12)


class RecordingStream:
    """Collects what the loop sends for one request; `fail_sends` makes every send raise."""

    def __init__(self, fail_sends: bool = False):
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = None
        self.error: tuple[ErrorKind, str] | None = None
        self.fail_sends = fail_sends
        self.done = threading.Event()

    def is_cancelled(self) -> bool:
        return False

    def send_output(self, output) -> None:
        if self.fail_sends:
            raise RuntimeError("cannot encode")
        self.token_ids += output.token_ids
        self.text += output.text
        if output.finished:
            self.finish_reason = output.finish_reason
            self.done.set()

    def send_error(self, kind: ErrorKind, message: str) -> None:
        self.error = (kind, message)
        self.done.set()


class RecordingMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802 (the name pb_utils uses)
        return RecordingMetric()


class RecordingMetric:
    def __init__(self):
        self.value = 0.0

    def increment(self, value):
        self.value += value

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.value += value


class EngineFailingAtStep(Diffulex):
    def __init__(self, model, failing_step: int, **settings):
        super().__init__(model, warm_up=False, **settings)  # its steps count from the first request on
        self.failing_step = failing_step
        self.num_steps = 0

    def step_deltas(self):  # what the served loop steps with
        self.num_steps += 1
        if self.num_steps == self.failing_step:
            raise RuntimeError("device lost")
        return super().step_deltas()


def start_loop(engine, **kwargs) -> tuple[EngineLoop, ServingMetrics]:
    metrics = ServingMetrics(RecordingMetricFamily, {"model": "diffulex"})
    return EngineLoop(engine, metrics, **kwargs), metrics


def wait_all(streams) -> None:
    for stream in streams:
        assert stream.done.wait(120), "a request never ended"


def test_a_response_that_cannot_be_sent_ends_with_internal_and_frees_its_pages(checkpoint, engine):
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    loop, metrics = start_loop(served)
    streams = [RecordingStream(), RecordingStream(fail_sends=True), RecordingStream()]
    prompts = ["first", "second", "third"]
    for prompt, stream in zip(prompts, streams):
        loop.submit(served.prepare_request(prompt, PARAMS), stream)
    wait_all(streams)
    loop.stop()
    expected = engine.generate(prompts, PARAMS)
    assert streams[1].error == (ErrorKind.INTERNAL, "building the response failed: RuntimeError: cannot encode")
    assert [streams[0].token_ids, streams[2].token_ids] == [expected[0].token_ids, expected[2].token_ids]
    assert streams[0].error is None and streams[2].error is None
    assert served.metrics().kv_pages_used == 0 and not served.has_unfinished_requests()
    assert metrics.kv_pages_used.value == 0


def test_stop_strings_match_on_the_response_thread_and_end_requests_as_in_process(checkpoint, engine):
    """The decoding thread hands over token ids only; the response thread makes the text, and a stop string that
    matches there ends the stream with what the in-process engine outputs, and frees the request's pages."""
    unstopped = engine.generate(["first", "second"], SamplingParams(max_tokens=24, ignore_eos=True))
    assert all(len(out.text) > 8 for out in unstopped)  # room for a stop string inside the output
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop=[out.text[len(out.text) // 2:][:2]])
              for out in unstopped]
    expected = engine.generate(["first", "second"], params)
    assert all(out.finish_reason.value == "stop" for out in expected)
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    decoding_threads = []
    decode = served.tokenizer.decode

    def recording_decode(*args, **kwargs):
        decoding_threads.append(threading.current_thread().name)
        return decode(*args, **kwargs)

    served.tokenizer.decode = recording_decode
    loop, metrics = start_loop(served)
    streams = [RecordingStream(), RecordingStream()]
    for prompt, p, stream in zip(["first", "second"], params, streams):
        loop.submit(served.prepare_request(prompt, p), stream)
    wait_all(streams)
    deadline = time.monotonic() + 30  # each stop's abort reaches the engine after the step under way
    while served.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert [(s.token_ids, s.text, s.finish_reason) for s in streams] == \
        [(out.token_ids, out.text, out.finish_reason) for out in expected]
    assert decoding_threads and set(decoding_threads) == {"diffulex-responses"}
    assert served.metrics().kv_pages_used == 0 and not served.has_unfinished_requests()


def test_an_engine_failure_ends_open_requests_and_refuses_new_ones(checkpoint):
    failures = []
    failing = EngineFailingAtStep(str(checkpoint), failing_step=3, **TEST_SETTINGS)
    loop, metrics = start_loop(failing, on_failure=lambda cause, message: failures.append((cause, message)))
    open_streams = [RecordingStream(), RecordingStream()]
    for stream in open_streams:
        loop.submit(failing.prepare_request("a prompt", SamplingParams(max_tokens=200)), stream)
    wait_all(open_streams)
    message = "the engine failed and this model can no longer serve: RuntimeError: device lost"
    assert [stream.error for stream in open_streams] == [(ErrorKind.INTERNAL, message)] * 2
    assert loop.state is LoopState.FAILED and failures == [(FailureCause.ENGINE, message)]
    assert metrics._errors["engine_failure"].value == 2
    late = RecordingStream()
    loop.submit(failing.prepare_request("another", PARAMS), late)
    assert late.error == (ErrorKind.UNAVAILABLE, message)
    loop.stop()


def test_stop_ends_open_requests_with_unavailable_and_refuses_new_ones(checkpoint):
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    loop, _ = start_loop(served)
    stream = RecordingStream()
    loop.submit(served.prepare_request("a long one", SamplingParams(max_tokens=400)), stream)
    loop.stop()
    assert stream.done.is_set()
    assert stream.error == (ErrorKind.UNAVAILABLE, "the model is being unloaded")
    late = RecordingStream()
    loop.submit(served.prepare_request("too late", PARAMS), late)
    assert late.error == (ErrorKind.UNAVAILABLE, "the model is being unloaded")


class EngineRefusingOnePrompt(Diffulex):
    """An engine whose add_request raises for one prompt, as a fault of ours might, after preparation passed."""

    def add_request(self, prompt, params=None, request_id=None):
        if isinstance(prompt, ResolvedRequest) and prompt.prompt_ids == self.tokenizer.encode("refused"):
            raise RuntimeError("cannot queue this one")
        return super().add_request(prompt, params, request_id)


def test_a_request_that_cannot_join_the_engine_ends_alone_and_the_others_finish(checkpoint, engine):
    served = EngineRefusingOnePrompt(str(checkpoint), **TEST_SETTINGS)
    loop, _ = start_loop(served)
    prompts = ["first", "refused", "third"]
    streams = [RecordingStream() for _ in prompts]
    for prompt, stream in zip(prompts, streams):
        loop.submit(served.prepare_request(prompt, PARAMS), stream)
    wait_all(streams)
    loop.stop()
    assert streams[1].error == (ErrorKind.INTERNAL, "RuntimeError: cannot queue this one")
    expected = engine.generate(["first", "third"], PARAMS)
    assert [streams[0].token_ids, streams[2].token_ids] == [out.token_ids for out in expected]
    assert loop.state is LoopState.STOPPED and served.metrics().kv_pages_used == 0


def test_the_response_thread_sleeps_while_nothing_is_open(checkpoint):
    """An idle model must not burn a core: the response thread waits for events instead of polling."""
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    loop, _ = start_loop(served, cancel_poll_interval_s=0.001)
    stream = RecordingStream()
    loop.submit(served.prepare_request("one request first", PARAMS), stream)
    wait_all([stream])
    thread_ids = {loop._response_thread.native_id, loop._decoding_thread.native_id}
    before = {tid: thread_cpu_seconds(tid) for tid in thread_ids}
    time.sleep(2.0)
    used = {tid: thread_cpu_seconds(tid) - before[tid] for tid in thread_ids}
    loop.stop()
    assert all(seconds < 0.05 for seconds in used.values()), used


def thread_cpu_seconds(native_id: int) -> float:
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class CancellableStream(RecordingStream):
    def __init__(self):
        super().__init__()
        self.cancelled = False
        self.polls = 0

    def is_cancelled(self) -> bool:
        self.polls += 1
        return self.cancelled


def test_cancellation_polls_take_open_requests_in_turn_and_every_cancel_is_noticed(checkpoint):
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    loop, _ = start_loop(served, cancel_poll_interval_s=0.005)
    streams = [CancellableStream() for _ in range(20)]
    for stream in streams:
        loop.submit(served.prepare_request("a long one", SamplingParams(max_tokens=400)), stream)
    time.sleep(0.5)
    for stream in streams[::2]:
        stream.cancelled = True
    wait_all(streams[::2])
    assert all(stream.error == (ErrorKind.CANCELLED, "the request was cancelled") for stream in streams[::2])
    assert all(stream.polls > 0 for stream in streams)  # every open request was polled, in turn
    deadline = time.monotonic() + 30
    while served.metrics().num_running != 10:  # the cancelled half left the engine
        assert time.monotonic() < deadline
        time.sleep(0.05)
    loop.stop()


class ThreadKilled(BaseException):
    """What escapes a thread's `except Exception`: a thread ends on it without a word unless guarded."""


class EngineDyingAtStep(Diffulex):
    def __init__(self, model, dying_step: int, **settings):
        super().__init__(model, warm_up=False, **settings)  # its steps count from the first request on
        self.dying_step = dying_step
        self.num_steps = 0

    def step_deltas(self):  # what the served loop steps with
        self.num_steps += 1
        if self.num_steps == self.dying_step:
            raise ThreadKilled("killed mid-step")
        return super().step_deltas()


def test_a_decoding_thread_that_dies_ends_open_requests_and_fails_the_loop(checkpoint):
    failures = []
    dying = EngineDyingAtStep(str(checkpoint), dying_step=3, **TEST_SETTINGS)
    loop, metrics = start_loop(dying, on_failure=lambda cause, message: failures.append((cause, message)))
    open_streams = [RecordingStream(), RecordingStream()]
    for stream in open_streams:
        loop.submit(dying.prepare_request("a prompt", SamplingParams(max_tokens=200)), stream)
    wait_all(open_streams)
    message = "the decoding thread stopped and this model can no longer serve: ThreadKilled: killed mid-step"
    assert [stream.error for stream in open_streams] == [(ErrorKind.INTERNAL, message)] * 2
    assert loop.state is LoopState.FAILED and failures == [(FailureCause.THREAD_DEATH, message)]
    assert metrics._errors["thread_death"].value == 2
    late = RecordingStream()
    loop.submit(dying.prepare_request("another", PARAMS), late)
    assert late.error == (ErrorKind.UNAVAILABLE, message)
    loop.stop()


class DyingCounter(RecordingMetric):
    def increment(self, value):
        raise ThreadKilled("killed while counting")


def test_a_response_thread_that_dies_leaves_the_decoding_thread_to_answer_every_request(checkpoint):
    failures = []
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    loop, metrics = start_loop(served, on_failure=lambda cause, message: failures.append((cause, message)))
    metrics.generation_tokens = DyingCounter()  # the first step that delivers tokens ends the response thread
    streams = [RecordingStream() for _ in range(3)]
    for stream in streams:
        loop.submit(served.prepare_request("a prompt", SamplingParams(max_tokens=200)), stream)
    wait_all(streams)
    message = "the response thread stopped and this model can no longer serve: ThreadKilled: killed while counting"
    assert [stream.error for stream in streams] == [(ErrorKind.INTERNAL, message)] * 3
    assert loop.state is LoopState.FAILED and failures == [(FailureCause.THREAD_DEATH, message)]
    late = RecordingStream()
    loop.submit(served.prepare_request("another", PARAMS), late)
    assert late.error == (ErrorKind.UNAVAILABLE, message)
    loop._decoding_thread.join(10)
    assert not loop._decoding_thread.is_alive()  # it answered what the response thread held, and stopped
    loop.stop()


def test_a_decoding_thread_that_cannot_start_fails_the_loop_construction(checkpoint, monkeypatch):
    def enter_device(self):
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr(EngineLoop, "_enter_device", enter_device)
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    with pytest.raises(RuntimeError, match="the decoding thread could not start: ValueError: Expected a torch.device"):
        start_loop(served)
