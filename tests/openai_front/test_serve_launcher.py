"""What `make serve` runs (tools/serve.py): tritonserver with the front beside it, the front reading the chat template
from the checkpoint that config.pbtxt names; SIGTERM to the launcher stops both, and its status is the server's."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from front_requests import DEMO_CHECKPOINT
from processes import alive, live_children
from triton_server import LAUNCHER, STARTUP_TIMEOUT_S, add_model, free_ports

SERVE = Path(__file__).resolve().parents[2] / "tools" / "serve.py"


def test_the_launcher_serves_openai_beside_tritonserver_and_stops_both(tmp_path):
    repository = tmp_path / "repository"
    add_model(repository, "diffulex", model=DEMO_CHECKPOINT)
    http, grpc, metrics, openai_port = free_ports(4)
    launcher = subprocess.Popen(
        [sys.executable, str(SERVE), "--openai-port", str(openai_port), "--openai-host", "127.0.0.1",
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
