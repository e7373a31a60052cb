"""A killed stub: Triton 2.51 never restarts a decoupled model's stub and keeps answering ready; the model's
watchdog makes it not ready at once and reloads it. A server of its own: after a stub's death, 2.51 keeps the old
model version UNLOADING and cannot shut down cleanly, so this server is killed at the end."""

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from processes import kill_with_children
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
