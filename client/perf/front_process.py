"""The OpenAI front as its users run it: its own process (`python -m diffulex_client.openai_front`), started on a
free loopback port in front of a tritonserver, stopped with SIGTERM. The front's tests and the serving benchmark
start it through this class."""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .tritonserver import LOOPBACK, LoggedProcess, free_ports

STARTUP_TIMEOUT_S = 120  # the front imports torch and transformers


class FrontProcess(LoggedProcess):
    def __init__(self, triton_url: str, model: str, log_path: Path, *args: str):
        (self.port,) = free_ports(1)
        self.url = f"http://{LOOPBACK}:{self.port}"
        super().__init__(
            [sys.executable, "-m", "diffulex_client.openai_front", "--triton-url", triton_url, "--model", model,
             "--host", LOOPBACK, "--port", str(self.port), *args], log_path,
            # The key is what the arguments say, whatever the environment running the tests holds.
            env={k: v for k, v in os.environ.items() if k != "DIFFULEX_OPENAI_API_KEY"})

    def health(self) -> int:
        """/health's status code, or 0 when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as err:
            return err.code
        except (urllib.error.URLError, ConnectionError):
            return 0

    def wait_listening(self, timeout_s: float = STARTUP_TIMEOUT_S, ready: bool = True) -> None:
        """Until /health answers (200 when `ready`, anything otherwise)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the front exited with {self.process.returncode}:\n{self.log_tail()}")
            status = self.health()
            if status == 200 or (status and not ready):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the front did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")
