"""Run a real tritonserver for tests: free ports on the loopback address, readiness, a checked shutdown."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LAUNCHER = Path(sys.executable).parent / "tritonserver"  # written into the venv by `make setup`
LOOPBACK = "127.0.0.1"
# The served test model's engine settings: small blocks, so that short outputs span several. The in-process
# reference engine uses the same.
TEST_SETTINGS = {"block_size": 4, "page_size": 4, "buffer_size": 2, "max_model_len": 512}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class TritonServer:
    def __init__(self, model_repository: Path, log_path: Path, extra_args: tuple[str, ...] = ()):
        if not LAUNCHER.is_file():
            raise RuntimeError(f"{LAUNCHER} is missing: run `make test-setup` first")
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.http_url = f"http://{LOOPBACK}:{self.http_port}"
        self.grpc_url = f"{LOOPBACK}:{self.grpc_port}"
        self.metrics_url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [str(LAUNCHER), "--model-repository", str(model_repository),
             "--http-address", LOOPBACK, "--http-port", str(self.http_port),
             "--grpc-address", LOOPBACK, "--grpc-port", str(self.grpc_port),
             "--metrics-address", LOOPBACK, "--metrics-port", str(self.metrics_port), *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, as a supervisor stops it, and wait for the exit; kill it if it hangs."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._log.close()


SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "model_repository" / "diffulex"

STARTUP_TIMEOUT_S = 300  # the Python backend imports torch twice (config auto-complete, then the model)
SHUTDOWN_TIMEOUT_S = 90


def with_parameters(config_text: str, name: str, **values) -> str:
    """The shipped config.pbtxt under another model name, with some engine parameters replaced."""
    config_text, count = re.subn(r'^name: "diffulex"$', f'name: "{name}"', config_text, flags=re.M)
    assert count == 1, "config.pbtxt has no `name:` line"
    for key, value in values.items():
        pattern = rf'(\{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
        config_text, count = re.subn(pattern, rf'\1"{value}"', config_text)
        assert count == 1, f"config.pbtxt has no parameter {key}"
    return config_text


def add_model(repository: Path, name: str, model_file: Path = SHIPPED_MODEL / "1" / "model.py", **values) -> None:
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(model_file, repository / name / "1" / "model.py")
    config_text = (SHIPPED_MODEL / "config.pbtxt").read_text()
    (repository / name / "config.pbtxt").write_text(with_parameters(config_text, name, **values))
