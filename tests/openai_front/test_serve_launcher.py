"""What `make serve` runs (tools/serve.py): tritonserver with the front beside it, the front reading the chat template
from the checkpoint that config.pbtxt names; SIGTERM to the launcher stops both, and its status is the server's. A
server that gRPC streams held open keep past its exit timeout is killed within the launcher's margin."""

import os
import queue
import shlex
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
from front_requests import DEMO_CHECKPOINT
from processes import alive, live_children
from triton_server import (LAUNCHER, SERVE_LAUNCHER, STARTUP_TIMEOUT_S, add_model, free_ports, serve_launcher,
                          wait_until_ready)

ROOT = Path(__file__).resolve().parents[2]


def test_the_launcher_serves_openai_beside_tritonserver_and_stops_both(tmp_path):
    repository = tmp_path / "repository"
    add_model(repository, "diffulex", model=DEMO_CHECKPOINT)
    http, grpc, metrics, openai_port = free_ports(4)
    launcher = subprocess.Popen(
        [sys.executable, str(SERVE_LAUNCHER), "--openai-port", str(openai_port), "--openai-host", "127.0.0.1",
         "--grpc-port", str(grpc), "--model-repository", str(repository), "--",
         str(LAUNCHER), "--model-repository", str(repository), "--model-control-mode=explicit",
         "--load-model=diffulex", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
         "--metrics-address", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics)],
        stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{openai_port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert launcher.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(0.5)
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                            json={"model": "diffulex", "messages": [{"role": "user", "content": "12+34="}]})
        assert answer.json()["choices"][0]["message"]["content"] == "46"
        children = live_children(launcher.pid)
        assert len(children) == 2
    finally:
        launcher.send_signal(signal.SIGTERM)
        returncode = launcher.wait(120)
    assert returncode == 0, (tmp_path / "serve.log").read_text()[-4000:]
    assert not any(alive(pid) for pid in children)


def make_serve_command(**variables) -> list[str]:
    """The command `make serve` runs, with these Makefile variables set."""
    assignments = [f"{name}={value}" for name, value in variables.items()]
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "serve", *assignments], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    (line,) = [line for line in recipe.replace("\\\n", " ").splitlines() if "tools/serve.py" in line]
    return shlex.split(line)


def held_streams(stack: ExitStack, grpc_url: str) -> None:
    """Two gRPC streams left open, as clients leave them: one that never sent a request, and one that had its
    answer."""
    idle = stack.enter_context(grpcclient.InferenceServerClient(grpc_url))
    idle.start_stream(callback=lambda result, error: None)
    answered = stack.enter_context(grpcclient.InferenceServerClient(grpc_url))
    responses = queue.Queue()
    answered.start_stream(callback=lambda result, error: responses.put((result, error)))
    prompt = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[b"12+34="]], dtype=object))
    answered.async_stream_infer("diffulex", [prompt])
    result, error = responses.get(timeout=60)
    assert error is None and result.get_response().parameters["triton_final_response"].bool_param


def descendants(pid: int) -> set[int]:
    """Every running process under pid; none once pid has ended."""
    if not alive(pid):
        return set()
    return {found for child in live_children(pid) for found in {child, *descendants(child)}}


def kill_alive(pids: set[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_make_serve_exits_within_its_exit_timeout_and_margin_while_grpc_streams_stay_open(tmp_path):
    exit_timeout_s = 3
    stop_bound_s = exit_timeout_s + serve_launcher().EXIT_MARGIN_S
    http, grpc, metrics, openai_port = free_ports(4)
    argv = make_serve_command(HTTP_PORT=http, GRPC_PORT=grpc, METRICS_PORT=metrics, OPENAI_PORT=openai_port,
                              EXIT_TIMEOUT_SECS=exit_timeout_s)
    log = tmp_path / "serve.log"
    launcher = subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    started = {launcher.pid}
    try:
        wait_until_ready(f"http://127.0.0.1:{http}", launcher, lambda: log.read_text()[-4000:])
        with ExitStack() as stack:
            held_streams(stack, f"127.0.0.1:{grpc}")
            started |= descendants(launcher.pid)
            signalled = time.monotonic()
            launcher.send_signal(signal.SIGTERM)
            returncode = launcher.wait(stop_bound_s + 10)
            stopped_after = time.monotonic() - signalled
        # The model's watchdog ends the stub of the killed server, then itself.
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in started)
    finally:
        kill_alive(started | descendants(launcher.pid))
    assert len(started) == 5  # the launcher, tritonserver, the front, the model's stub and its watchdog
    assert stop_bound_s <= stopped_after < stop_bound_s + 2
    assert returncode == 1
    assert f"tritonserver was still running {stop_bound_s} s after the signal" in log.read_text()
