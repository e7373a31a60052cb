"""Run a tritonserver from this environment: the load test's local server and the test suites' server.

The binary is the launcher `make setup` writes beside this Python. Ports are free ones on the loopback address
unless given; readiness is the server's HTTP health endpoint, which with the default model control turns ready
once every model has loaded. Stopping sends SIGTERM, as a supervisor does, and kills a server that hangs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

LAUNCHER = Path(sys.executable).parent / "tritonserver"
LOOPBACK = "127.0.0.1"
REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPOSITORY_ROOT / "model_repository"
STARTUP_TIMEOUT_S = 300  # the Python backend imports torch twice (config auto-complete, then the model)
SHUTDOWN_TIMEOUT_S = 90


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_until_ready(http_url: str, process: subprocess.Popen, log_tail: Callable[[], str],
                     timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until the health endpoint of the tritonserver at `http_url` says ready. `process` runs it (the server, or a
    launcher of it): RuntimeError, with `log_tail()`, once it has exited or the time has run out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{log_tail()}")
        try:
            with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"tritonserver was not ready within {timeout_s:.0f} s:\n{log_tail()}")


class LoggedProcess:
    """A child process whose output goes to a log file, stopped with SIGTERM."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=os.environ.copy() if env is None else env)

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int:
        """The exit status; a process that does not exit within the timeout is killed and TimeoutExpired raised."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._log.close()


class TritonServer(LoggedProcess):
    """One tritonserver process. `ports` is (http, grpc, metrics), free ones by default; `address` is the
    interface each endpoint binds, the loopback by default, or None for tritonserver's own default (all)."""

    def __init__(self, model_repository: Path, log_path: Path, extra_args: tuple[str, ...] = (), *,
                 ports: tuple[int, int, int] | None = None, address: str | None = LOOPBACK):
        if not LAUNCHER.is_file():
            raise RuntimeError(f"{LAUNCHER} is missing: run `make setup` first")
        self.http_port, self.grpc_port, self.metrics_port = ports or free_ports(3)
        host = address or LOOPBACK
        self.http_url = f"http://{host}:{self.http_port}"
        self.grpc_url = f"{host}:{self.grpc_port}"
        self.metrics_url = f"http://{host}:{self.metrics_port}/metrics"
        endpoints = []
        for endpoint, port in (("http", self.http_port), ("grpc", self.grpc_port), ("metrics", self.metrics_port)):
            endpoints += ([f"--{endpoint}-address", address] if address else []) + [f"--{endpoint}-port", str(port)]
        super().__init__([str(LAUNCHER), "--model-repository", str(model_repository), *endpoints, *extra_args],
                         log_path)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_until_ready(self.http_url, self.process, self.log_tail, timeout_s)

