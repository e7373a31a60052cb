"""What the deployments' probes read, in a real tritonserver started with the Deployment's own options: after an
engine failure the server's readiness turns false (so the replica leaves the Service's endpoints) while its
liveness stays true (so it is not restarted), and readiness comes back once the model is reloaded."""

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from triton_server import SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, TEST_SETTINGS, TritonServer, add_model

DEPLOYMENT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "deployment.yaml"
FAILING_MODEL = Path(__file__).resolve().parents[1] / "server" / "failing_model.py"
# Set by the test harness, not by the manifest.
HARNESS_OPTIONS = ("--model-repository", "--http-port", "--grpc-port", "--metrics-port")


def deployment_container() -> dict:
    (container,) = [item for item in yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"]
                    if item["name"] == "tritonserver"]
    return container


@pytest.fixture
def manifest_server(tmp_path, checkpoint):
    container = deployment_container()
    options = tuple(arg for arg in container["args"] if not arg.startswith(HARNESS_OPTIONS))
    # The model the manifest loads, under its name, with an engine that fails at every step.
    add_model(tmp_path / "repository", "diffulex", FAILING_MODEL, model=checkpoint, **TEST_SETTINGS)
    server = TritonServer(tmp_path / "repository", tmp_path / "tritonserver.log", options)
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        yield server
    finally:
        assert server.stop(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()


def status(server, path: str) -> int:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def wait_for_status(server, path: str, wanted, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := status(server, path)) not in wanted:
        assert time.monotonic() < deadline, f"{path} answered {code}, not {wanted}, for {timeout_s} s"
        time.sleep(0.01)
    return code


def test_an_engine_failure_takes_the_replica_out_of_readiness_but_not_out_of_liveness(manifest_server):
    server = manifest_server
    container = deployment_container()
    ready, live = container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]
    assert status(server, ready) == 200 and status(server, live) == 200

    def request():  # ends with an error when the engine fails; its answer is not what this test is about
        body = json.dumps({"text_input": "hello", "parameters": {"max_tokens": 4}}).encode()
        try:
            urllib.request.urlopen(urllib.request.Request(f"{server.http_url}/v2/models/diffulex/generate", body),
                                   timeout=60).read()
        except urllib.error.HTTPError:
            pass

    sender = threading.Thread(target=request)
    sender.start()
    wait_for_status(server, ready, {400, 503}, timeout_s=10)
    assert status(server, live) == 200
    wait_for_status(server, ready, {200}, timeout_s=120)
    sender.join(timeout=60)
    # The test engine fails at its first step, so the watchdog counts it as a failure at start.
    assert "model 'diffulex' failed before its first step: reloading it (1 of 3 tries)" in server.log_tail(20000)
