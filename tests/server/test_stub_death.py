"""A killed stub: Triton 2.51 never restarts a decoupled model's stub and keeps answering ready; the model's
watchdog makes it not ready at once and reloads it. A killed server: its stub, which Triton 2.51 leaves running
with a request open, ends within seconds. Servers of their own: after a stub's death, 2.51 keeps the old model
version UNLOADING and cannot shut down cleanly, so these servers are killed at the end."""

import json
import os
import signal
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from diffulex_backend.serving.stub_watchdog import reloads_file
from processes import alive, kill_with_children, live_children
from served import generate, post, reference, stub_pids, wait_for
from triton_server import STARTUP_TIMEOUT_S, TEST_SETTINGS, TritonServer, add_model

GREEDY = {"max_tokens": 8, "temperature": 0}


@pytest.fixture
def own_server(tmp_path, checkpoint):
    repository = tmp_path / "repository"
    add_model(repository, "diffulex", model=checkpoint, **TEST_SETTINGS)
    server = TritonServer(repository, tmp_path / "tritonserver.log",
                          ("--model-control-mode=explicit", "--load-model=diffulex", "--exit-timeout-secs=5"))
    server.wait_ready(STARTUP_TIMEOUT_S)
    yield server
    kill_with_children(server.process)


def test_a_killed_stub_makes_the_model_not_ready_at_once_and_it_comes_back(own_server, engine):
    server = own_server
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        (stub,) = stub_pids(server, "diffulex")
        # In flight at the kill: no process can answer it any more, so it is abandoned.
        abandoned = ThreadPoolExecutor(1).submit(post, f"{server.http_url}/v2/models/diffulex/generate",
                                                 {"text_input": "hello", "parameters": {"max_tokens": 400}})
        os.kill(stub, signal.SIGKILL)
        wait_for(lambda: not client.is_model_ready("diffulex"), timeout_s=5)
        status, payload = post(f"{server.http_url}/v2/models/diffulex/generate",
                               {"text_input": "hello", "parameters": GREEDY})
        assert status in (400, 404) and json.loads(payload)["error"]
        wait_for(lambda: client.is_model_ready("diffulex"), timeout_s=120)
    (expected,) = reference(engine, ["hello"], **GREEDY)
    output = generate(server, {"text_input": "hello", "parameters": GREEDY, "exclude_input_in_output": True})
    assert output["text_output"] == expected.text
    assert stub_pids(server, "diffulex") not in ([], [stub])
    assert "the stub of model 'diffulex' (pid %d) died: reloading the model" % stub in server.log_path.read_text()
    assert not abandoned.done() or abandoned.result()[0] != 200


def open_stream(server) -> threading.Event:
    """A long generate_stream request, read on a thread of its own; the event is set at its first response."""
    started = threading.Event()
    body = {"text_input": "hello", "parameters": {"max_tokens": 400, "temperature": 0}}
    request = urllib.request.Request(f"{server.http_url}/v2/models/diffulex/generate_stream",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})

    def read():
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for line in response:
                    if line.startswith(b"data:"):
                        started.set()
        except OSError:
            pass  # the server is gone

    threading.Thread(target=read, daemon=True).start()
    return started


@pytest.mark.parametrize("model_control", [("--model-control-mode=explicit", "--load-model=diffulex"), ()],
                         ids=["explicit", "default"])
@pytest.mark.parametrize("crash", [signal.SIGSEGV, signal.SIGKILL], ids=["SIGSEGV", "SIGKILL"])
def test_the_stub_of_a_crashed_server_ends_with_its_request_open_and_frees_its_shared_memory(
        tmp_path, checkpoint, model_control, crash):
    """The server dies with a stream open and is not reaped (a zombie, as under a parent that has not waited for
    it yet): Triton's stub would keep running, its memory held, until then, and often for ever after (it hangs in
    its own teardown). The watchdog ends it and its shared-memory region within seconds."""
    repository = tmp_path / "repository"
    add_model(repository, "diffulex", model=checkpoint, **TEST_SETTINGS)
    server = TritonServer(repository, tmp_path / "tritonserver.log", (*model_control, "--exit-timeout-secs=5"))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        (stub,) = stub_pids(server, "diffulex")
        (watchdog,) = live_children(stub)
        region = Path("/dev/shm") / Path(f"/proc/{stub}/cmdline").read_bytes().split(b"\0")[2].decode()
        assert region.name.startswith("triton_python_backend_shm_region_") and region.exists()
        assert open_stream(server).wait(60), "the stream never started"
        # As a model that failed at start and was reloaded leaves it: the count goes with the server.
        reloads = reloads_file(server.process.pid, "diffulex")
        reloads.write_text("[]")
        os.kill(server.process.pid, crash)
        wait_for(lambda: not alive(stub) and not alive(watchdog), timeout_s=10)
        assert not region.exists()
        assert not reloads.exists()
        assert server.process.returncode is None  # never reaped while the stub ended
        assert f"the stub of model 'diffulex' (pid {stub}) outlived it" in server.log_path.read_text()
    finally:
        kill_with_children(server.process)
