"""The front while tritonserver or its model is away: 503 before the server is up, serving within seconds once it
is, and when the model's stub dies mid-stream the open stream ends with an error event within a second, new requests
get 503; once the server is killed the front answers 503 still, and it serves a new server on the same ports within
seconds (that the watchdog brings the model back is tests/server/test_stub_death.py's); servers of their own, killed
at the end, because after a stub's death Triton 2.51 cannot shut down cleanly. On the session's server, a model
unloaded under an open stream ends it, gets 503, and is served again once it is loaded again."""

import os
import signal
import time
from pathlib import Path

import httpx
import tritonclient.http as httpclient
from diffulex_client.perf.front_process import FrontProcess
from front_requests import error_in, post
from processes import kill_with_children, live_children
from google.protobuf import json_format, text_format
from triton_server import SHIPPED_MODEL, STARTUP_TIMEOUT_S, TEST_SETTINGS, TritonServer, add_model, free_ports, \
    with_parameters
from tritonclient.grpc import model_config_pb2

BODY = {"model": "diffulex", "prompt": "hello", "max_tokens": 8, "temperature": 0}
# Decoding that outlasts the stub: the stream is open when the stub is killed.
ENDLESS = {**BODY, "max_tokens": 500, "ignore_eos": True, "stream": True}


def wait_until(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


def stub_of(server: TritonServer) -> int:
    (pid,) = [pid for pid in live_children(server.process.pid)
              if b"/diffulex/1/model.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return pid


def start_server(tmp_path, checkpoint, ports, name: str) -> TritonServer:
    repository = tmp_path / name
    add_model(repository, "diffulex", model=checkpoint, **TEST_SETTINGS)
    server = TritonServer(repository, tmp_path / f"{name}.log",
                          ("--model-control-mode=explicit", "--load-model=diffulex", "--exit-timeout-secs=5"),
                          ports=ports)
    server.wait_ready(STARTUP_TIMEOUT_S)
    return server


def test_the_front_answers_503_while_triton_is_away_and_ends_streams_on_a_dead_stub(tmp_path, checkpoint):
    ports = tuple(free_ports(3))
    front = FrontProcess(f"127.0.0.1:{ports[1]}", "diffulex", tmp_path / "front.log")
    servers = []
    try:
        front.wait_listening(ready=False)
        response = post(front, "/v1/completions", BODY)
        assert response.status_code == 503 and "cannot be reached" in error_in(response.text)["message"]
        assert front.health() == 503

        servers.append(start_server(tmp_path, checkpoint, ports, "first"))
        assert wait_until(lambda: front.health() == 200, timeout_s=5) < 3  # connected
        assert post(front, "/v1/completions", BODY).status_code == 200

        with httpx.stream("POST", f"{front.url}/v1/completions", json=ENDLESS, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(stub_of(servers[0]), signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            ended_after = time.monotonic() - killed
        assert ended_after < 1.5, ended_after
        assert rest[-1] == "data: [DONE]"
        assert error_in(rest[-2][len("data: "):])["code"] == "model_not_ready"

        refused = post(front, "/v1/completions", BODY)
        assert refused.status_code == 503 and error_in(refused.text)["code"] == "model_not_ready"

        # Killed: after a stub's death Triton 2.51 cannot shut down cleanly (and at times aborts by itself while the
        # watchdog reloads the model, on a lock the dead stub held). Then a new server on the same ports.
        kill_with_children(servers[0].process)
        wait_until(lambda: front.health() == 503, timeout_s=5)
        assert post(front, "/v1/completions", BODY).status_code == 503
        servers.append(start_server(tmp_path, checkpoint, ports, "second"))
        assert wait_until(lambda: front.health() == 200, timeout_s=5) < 3  # reconnected by itself
        assert post(front, "/v1/completions", BODY).status_code == 200
    finally:
        for server in servers:
            if server.process.poll() is None:
                kill_with_children(server.process)
        front.stop()


def test_a_model_unloaded_and_loaded_again_is_served_again_through_the_same_connection(server, checkpoint, tmp_path):
    name = "diffulex_front_reload"
    triton = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))

    def load():
        config_text = with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), name, model=checkpoint,
                                      **TEST_SETTINGS)
        config = json_format.MessageToJson(text_format.Parse(config_text, model_config_pb2.ModelConfig()))
        triton.load_model(name, config=config,
                          files={"file:1/model.py": (SHIPPED_MODEL / "1" / "model.py").read_bytes()})

    load()
    front = FrontProcess(server.grpc_url, name, tmp_path / "front.log")
    try:
        front.wait_listening()
        body = {**ENDLESS, "model": name}
        with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            triton.unload_model(name)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        wait_until(lambda: front.health() == 503, timeout_s=5)
        refused = post(front, "/v1/completions", {**BODY, "model": name})
        assert refused.status_code == 503 and error_in(refused.text)["code"] == "model_not_ready"
        load()
        assert wait_until(lambda: front.health() == 200, timeout_s=5) < 1
        assert post(front, "/v1/completions", {**BODY, "model": name}).status_code == 200
    finally:
        front.stop()
        triton.unload_model(name)
