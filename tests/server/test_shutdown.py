"""Shutdown and unload finish promptly with streams open: each stream ends with an error event instead of being cut
off, the model is finalized and the server exits 0, where tritonserver 2.51 alone waits out its exit timeout and
crashes. A server of its own, whose engine sleeps in every step so that streams outlive the signal."""

import http.client
import json
import signal
import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from processes import kill_with_children
from triton_server import STARTUP_TIMEOUT_S, TEST_SETTINGS, TritonServer, add_model

LEAVING = b'data: {"error":"the server is shutting down or unloading this model"}'
LONG = {"max_tokens": 400, "ignore_eos": True}  # 100 blocks of 4 at 0.5 s a step: far longer than the test


@pytest.fixture
def slow_server(tmp_path, checkpoint):
    repository = tmp_path / "repository"
    add_model(repository, "diffulex", Path(__file__).parent / "slow_model.py", model=checkpoint, **TEST_SETTINGS)
    server = TritonServer(repository, tmp_path / "tritonserver.log",
                          ("--model-control-mode=explicit", "--load-model=diffulex", "--exit-timeout-secs=60"))
    server.wait_ready(STARTUP_TIMEOUT_S)
    yield server
    if server.process.poll() is None:
        kill_with_children(server.process)


class Stream(threading.Thread):
    """One generate_stream request; records its events and when it ended."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server = server
        self.events: list[bytes] = []
        self.ended_at: float | None = None
        self.first_event = threading.Event()

    def run(self):
        connection = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=120)
        connection.request("POST", "/v2/models/diffulex/generate_stream",
                           json.dumps({"text_input": "hello", "stream": True, "parameters": LONG}))
        for line in connection.getresponse():
            if line.startswith(b"data: "):
                self.events.append(line.strip())
                self.first_event.set()
        self.ended_at = time.monotonic()


def open_streams(server, count: int) -> list[Stream]:
    streams = [Stream(server) for _ in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_event.wait(60), "a stream never started"
    return streams


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_server_ends_open_streams_with_an_error_and_exits_0(slow_server, signal_number):
    streams = open_streams(slow_server, 3)
    signalled = time.monotonic()
    slow_server.process.send_signal(signal_number)
    returncode = slow_server.process.wait(60)
    exited = time.monotonic() - signalled
    for stream in streams:
        stream.join(10)
        assert stream.events[-1] == LEAVING
        assert stream.ended_at - signalled < 5
    log = slow_server.log_path.read_text(errors="replace")
    assert returncode == 0, log[-3000:]
    assert exited < 20  # the exit timeout is 60 s: it was not waited out
    assert "successfully unloaded 'diffulex' version 1" in log


def test_an_unload_with_streams_open_ends_them_with_an_error_and_completes(slow_server):
    streams = open_streams(slow_server, 2)
    asked = time.monotonic()
    with grpcclient.InferenceServerClient(slow_server.grpc_url) as client:
        client.unload_model("diffulex")
        deadline = time.monotonic() + 20
        while client.is_model_ready("diffulex") or any(s.ended_at is None for s in streams):
            assert time.monotonic() < deadline, "the unload waited for the streams"
            time.sleep(0.1)
    for stream in streams:
        assert stream.events[-1] == LEAVING
        assert stream.ended_at - asked < 5
    assert slow_server.stop(60) == 0
