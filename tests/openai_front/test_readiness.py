"""The front while tritonserver or its model is away: 503 before the server is up, serving within seconds once it
is, and when the model's stub dies mid-stream the open stream ends with an error event within a second, new requests
get 503 until the watchdog has reloaded the model, then it serves again; once the server is killed the front answers
503 again, and it serves a new server on the same ports within seconds. Servers of its own: after a stub's death Triton 2.51 cannot shut
down cleanly, so they are killed."""

import os
import signal
import time
from pathlib import Path

import httpx
from front_process import FrontProcess
from front_requests import error_in, post
from processes import live_children
from triton_server import STARTUP_TIMEOUT_S, TEST_SETTINGS, TritonServer, add_model, free_ports

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
        assert '"error"' in rest[-2] and "not ready" in rest[-2]

        refused = post(front, "/v1/completions", BODY)
        assert refused.status_code == 503 and error_in(refused.text)["code"] == "model_not_ready"
        wait_until(lambda: front.health() == 200, timeout_s=120)  # the watchdog reloaded the model
        assert post(front, "/v1/completions", BODY).json()["choices"][0]["finish_reason"] in ("stop", "length")

        # Killed: after a stub's death Triton 2.51 cannot shut down cleanly. Then a new server on the same ports.
        servers[0].process.kill()
        servers[0].process.wait()
        wait_until(lambda: front.health() == 503, timeout_s=5)
        assert post(front, "/v1/completions", BODY).status_code == 503
        servers.append(start_server(tmp_path, checkpoint, ports, "second"))
        assert wait_until(lambda: front.health() == 200, timeout_s=5) < 3  # reconnected by itself
        assert post(front, "/v1/completions", BODY).status_code == 200
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()
        front.stop()
