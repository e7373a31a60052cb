"""`make serve`: tritonserver and, next to it, the OpenAI-compatible front, which stops when the server does.

    python tools/serve.py --openai-port 9000 --grpc-port 8001 -- tritonserver --model-repository ...

SIGINT and SIGTERM go to tritonserver, which ends its open requests and exits; the front is then stopped, and the
exit status is the server's. A server still running EXIT_MARGIN_S seconds past its exit timeout (its
--exit-timeout-secs, 30 by default) after the first signal is killed, and the status is then 1: tritonserver 2.51
stops its gRPC endpoint by waiting, with no deadline, for every open gRPC stream to end, so a stream that a client
holds open (tritonclient's start_stream without stop_stream) would keep it running for ever.

The front reads the chat template from the checkpoint of the model's config.pbtxt (its `model` parameter, relative
to the model's folder) unless --tokenizer names another.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

FRONT_STOP_TIMEOUT_S = 15
TRITON_EXIT_TIMEOUT_S = 30  # tritonserver's own default for --exit-timeout-secs
# What tritonserver takes, once its exit timeout has run out, to stop its endpoints and exit when no gRPC stream holds
# it (under a second, measured), with room to spare.
EXIT_MARGIN_S = 5
WAIT_SLICE_S = 0.2


def checkpoint_of(model_repository: Path, model: str) -> Path | None:
    """The `model` parameter of the model's config.pbtxt, as a directory."""
    config = model_repository / model / "config.pbtxt"
    match = re.search(r'key:\s*"model",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config.read_text())
    if not match or not match.group(1):
        return None
    path = Path(match.group(1))
    return path if path.is_absolute() else model_repository / model / path


def exit_timeout_of(server_command: list[str]) -> float:
    """The server's --exit-timeout-secs (`--exit-timeout-secs N` or `=N`; the last one given counts)."""
    timeout = TRITON_EXIT_TIMEOUT_S
    for i, arg in enumerate(server_command):
        name, equals, value = arg.partition("=")
        if name == "--exit-timeout-secs":
            timeout = float(value if equals else server_command[i + 1])
    return timeout


class Signals:
    """Forwards SIGINT and SIGTERM to the server, and remembers when the first came."""

    def __init__(self, server: subprocess.Popen):
        self.server = server
        self.first_at: float | None = None

    def forward(self, signum, _frame):
        self.server.send_signal(signum)
        if self.first_at is None:
            self.first_at = time.monotonic()

    def overdue(self, stop_timeout_s: float) -> bool:
        return self.first_at is not None and time.monotonic() - self.first_at > stop_timeout_s


def wait_for_server(server: subprocess.Popen, signals: Signals, stop_timeout_s: float) -> int:
    """The server's exit status; 1 once it has been killed for outliving stop_timeout_s after the first signal."""
    while True:
        try:
            return server.wait(WAIT_SLICE_S)
        except subprocess.TimeoutExpired:
            if signals.overdue(stop_timeout_s):
                break
    # Only the server: the model's watchdog ends a stub whose server is gone, and removes its shared memory.
    server.kill()
    server.wait()
    print(f"serve: tritonserver was still running {stop_timeout_s:g} s after the signal (Triton 2.51 waits for open "
          "gRPC streams without a deadline); killed it", file=sys.stderr, flush=True)
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openai-port", type=int, default=9000)
    parser.add_argument("--openai-host", default="0.0.0.0")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="diffulex")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("server_command", nargs=argparse.REMAINDER, help="-- then the tritonserver command")
    args = parser.parse_args()
    command = args.server_command[1:] if args.server_command[:1] == ["--"] else args.server_command
    if not command:
        parser.error("give the tritonserver command after --")

    try:
        stop_timeout_s = exit_timeout_of(command) + EXIT_MARGIN_S
    except (ValueError, IndexError):
        parser.error("the tritonserver command's --exit-timeout-secs must be a number of seconds")

    tokenizer = args.tokenizer or checkpoint_of(args.model_repository, args.model)
    # Sessions of their own: a terminal's Ctrl-C reaches this launcher alone, so the server gets each signal once,
    # from it, and not a second time from the terminal's process group.
    server = subprocess.Popen(command, start_new_session=True)
    front_command = [sys.executable, "-m", "diffulex_client.openai_front", "--triton-url",
                     f"localhost:{args.grpc_port}", "--model", args.model, "--host", args.openai_host,
                     "--port", str(args.openai_port)]
    if tokenizer is not None:
        front_command += ["--tokenizer", str(tokenizer)]
    front = subprocess.Popen(front_command, start_new_session=True)

    signals = Signals(server)
    signal.signal(signal.SIGINT, signals.forward)
    signal.signal(signal.SIGTERM, signals.forward)

    def report_front_exit():  # the server goes on serving Triton's own endpoints; say why port 9000 is gone
        returncode = front.wait()
        if server.poll() is None:
            print(f"serve: the OpenAI front exited with {returncode}; tritonserver keeps serving", file=sys.stderr,
                  flush=True)

    threading.Thread(target=report_front_exit, daemon=True).start()
    try:
        returncode = wait_for_server(server, signals, stop_timeout_s)
    finally:
        front.terminate()
        try:
            front.wait(FRONT_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            front.kill()
            front.wait()
    return returncode


if __name__ == "__main__":
    sys.exit(main())
