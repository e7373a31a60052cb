"""The engine loop's failure paths, with a real engine in this process: what the server cannot be made to do
on demand (a response that cannot be sent, an engine that fails mid-step, an unload with requests open)."""

import threading

import pytest
from triton_server import TEST_SETTINGS

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.serving.engine_loop import EngineLoop, ErrorKind, LoopState
from diffulex_backend.serving.metrics import ServingMetrics

PARAMS = SamplingParams(max_tokens=12)


class RecordingStream:
    """Collects what the loop sends for one request; `fail_sends` makes every send raise."""

    def __init__(self, fail_sends: bool = False):
        self.token_ids: list[int] = []
        self.error: tuple[ErrorKind, str] | None = None
        self.fail_sends = fail_sends
        self.done = threading.Event()

    def is_cancelled(self) -> bool:
        return False

    def send_output(self, output) -> None:
        if self.fail_sends:
            raise RuntimeError("cannot encode")
        self.token_ids += output.token_ids
        if output.finished:
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
        super().__init__(model, **settings)
        self.failing_step = failing_step
        self.num_steps = 0

    def step(self):
        self.num_steps += 1
        if self.num_steps == self.failing_step:
            raise RuntimeError("device lost")
        return super().step()


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
        loop.submit(prompt, PARAMS, stream)
    wait_all(streams)
    loop.stop()
    expected = engine.generate(prompts, PARAMS)
    assert streams[1].error == (ErrorKind.INTERNAL, "building the response failed: RuntimeError: cannot encode")
    assert [streams[0].token_ids, streams[2].token_ids] == [expected[0].token_ids, expected[2].token_ids]
    assert streams[0].error is None and streams[2].error is None
    assert served.metrics().kv_pages_used == 0 and not served.has_unfinished_requests()
    assert metrics.kv_pages_used.value == 0


def test_an_engine_failure_ends_open_requests_and_refuses_new_ones(checkpoint):
    failures = []
    loop, _ = start_loop(EngineFailingAtStep(str(checkpoint), failing_step=3, **TEST_SETTINGS),
                         on_failure=failures.append)
    open_streams = [RecordingStream(), RecordingStream()]
    for stream in open_streams:
        loop.submit("a prompt", SamplingParams(max_tokens=200), stream)
    wait_all(open_streams)
    message = "the engine failed and this model can no longer serve: RuntimeError: device lost"
    assert [stream.error for stream in open_streams] == [(ErrorKind.INTERNAL, message)] * 2
    assert loop.state is LoopState.FAILED and failures == ["RuntimeError: device lost"]
    late = RecordingStream()
    loop.submit("another", PARAMS, late)
    assert late.error == (ErrorKind.UNAVAILABLE, message)
    loop.stop()


def test_stop_ends_open_requests_with_unavailable_and_refuses_new_ones(checkpoint):
    served = Diffulex(str(checkpoint), **TEST_SETTINGS)
    loop, _ = start_loop(served)
    stream = RecordingStream()
    loop.submit("a long one", SamplingParams(max_tokens=400), stream)
    loop.stop()
    assert stream.done.is_set()
    assert stream.error == (ErrorKind.UNAVAILABLE, "the model is being unloaded")
    late = RecordingStream()
    loop.submit("too late", PARAMS, late)
    assert late.error == (ErrorKind.UNAVAILABLE, "the model is being unloaded")


@pytest.mark.parametrize("prompt", ["x" * 600, [10**6]], ids=["over-long prompt", "token id out of range"])
def test_a_request_the_engine_refuses_ends_with_invalid_arg_and_its_message(checkpoint, engine, prompt):
    with pytest.raises(ValueError) as refused:
        engine.add_request(prompt, PARAMS)
    loop, _ = start_loop(Diffulex(str(checkpoint), **TEST_SETTINGS))
    stream = RecordingStream()
    loop.submit(prompt, PARAMS, stream)
    wait_all([stream])
    loop.stop()
    assert stream.error == (ErrorKind.INVALID_ARG, str(refused.value))
