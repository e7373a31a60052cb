"""`make serve`: tritonserver and, next to it, the OpenAI-compatible front, which stops when the server does.

    python tools/serve.py --openai-port 9000 --grpc-port 8001 -- tritonserver --model-repository ...

SIGINT and SIGTERM go to tritonserver, which ends its open requests and exits; the front is then stopped, and the
exit status is the server's. The front reads the chat template from the checkpoint of the model's config.pbtxt
(its `model` parameter, relative to the model's folder) unless --tokenizer names another.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

FRONT_STOP_TIMEOUT_S = 15


def checkpoint_of(model_repository: Path, model: str) -> Path | None:
    """The `model` parameter of the model's config.pbtxt, as a directory."""
    config = model_repository / model / "config.pbtxt"
    match = re.search(r'key:\s*"model",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config.read_text())
    if not match or not match.group(1):
        return None
    path = Path(match.group(1))
    return path if path.is_absolute() else model_repository / model / path


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

    tokenizer = args.tokenizer or checkpoint_of(args.model_repository, args.model)
    # Sessions of their own: a terminal's Ctrl-C reaches this launcher alone, which hands it to the server once
    # (a second SIGINT makes tritonserver skip its graceful shutdown).
    server = subprocess.Popen(command, start_new_session=True)
    front_command = [sys.executable, "-m", "diffulex_client.openai_front", "--triton-url",
                     f"localhost:{args.grpc_port}", "--model", args.model, "--host", args.openai_host,
                     "--port", str(args.openai_port)]
    if tokenizer is not None:
        front_command += ["--tokenizer", str(tokenizer)]
    front = subprocess.Popen(front_command, start_new_session=True)

    def forward(signum, _frame):
        server.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    def report_front_exit():  # the server goes on serving Triton's own endpoints; say why port 9000 is gone
        returncode = front.wait()
        if server.poll() is None:
            print(f"serve: the OpenAI front exited with {returncode}; tritonserver keeps serving", file=sys.stderr,
                  flush=True)

    threading.Thread(target=report_front_exit, daemon=True).start()
    try:
        returncode = server.wait()
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
