"""Bring the model back when its Python stub dies or its engine fails, through tritonserver's repository API.

Triton 2.51 never restarts the stub of a decoupled model: once the stub is killed (the kernel's OOM killer, a
fault in native code), every request gets "Stub process ... is not healthy" while every health endpoint still
answers 200, until the server is restarted. So the model starts this watchdog as a child process in its own
session, with a pipe to it, and tells it how things end:
  * "clean" on a normal finalize: the watchdog exits;
  * "reload" when the engine has failed, or a thread of the model ended: the watchdog reloads the model, which gets
    a fresh process and engine;
  * "reload-at-start" for the same, when the engine had served no step since the load: the watchdog reloads the
    model unless it has done so MAX_RELOADS_AT_START times in the last RELOAD_WINDOW_S seconds already. A model
    that fails before its first step on every load then stays unloaded (not ready), and the log says why, rather
    than being reloaded for ever;
  * nothing (the pipe closes because the stub died): the watchdog reloads the model.
Reloading is unload, then load: the model reports not ready, and new requests get "unknown model", as soon as the
unload is asked; it is back once the load ends. The repository API needs `--model-control-mode=explicit`; the
model starts no watchdog under other modes. Requests that were in flight when the stub died cannot be answered
by anything: Triton 2.51 keeps their streams open, so clients need a timeout of their own.

It runs as a script, importing nothing but the standard library, so it costs a few megabytes.

    python stub_watchdog.py --stub-pid PID --server-pid PID --model NAME --host HOST --port PORT
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("diffulex.stub_watchdog")

CLEAN, RELOAD, RELOAD_AT_START = b"clean", b"reload", b"reload-at-start"
LOAD_TIMEOUT_S = 3600  # a large checkpoint loads for minutes
MAX_RELOADS_AT_START = 3
RELOAD_WINDOW_S = 600.0


def reloads_file(server_pid: int, model: str) -> Path:
    """Where the reloads at start of one model of one server are kept: each watchdog lives for one load only."""
    return Path(tempfile.gettempdir()) / f"diffulex-watchdog-{server_pid}-{model}.json"


def recent_reloads_at_start(path: Path, now: float) -> list[float]:
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [t for t in times if isinstance(t, (int, float)) and now - t < RELOAD_WINDOW_S]


def process_is_gone(pid: int) -> bool:
    """Gone or a zombie: a dead stub stays a zombie until tritonserver reaps it, and kill(pid, 0) still works."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_until_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not process_is_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def repository_call(host: str, port: int, model: str, action: str) -> tuple[int | None, str]:
    connection = http.client.HTTPConnection(host, port, timeout=LOAD_TIMEOUT_S)
    try:
        connection.request("POST", f"/v2/repository/models/{model}/{action}", body=json.dumps({}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    except OSError as err:
        return None, f"{type(err).__name__}: {err}"
    finally:
        connection.close()


def reload_model(host: str, port: int, model: str, attempts: int = 5) -> bool:
    """Unload, then load. A load can be refused while another reload of the same model is under way (its engine
    failed again at once); it is tried again, a second apart."""
    status, body = repository_call(host, port, model, "unload")
    logger.warning("unload of model '%s': %s %s", model, status, body[:300])
    for attempt in range(attempts):
        status, body = repository_call(host, port, model, "load")
        logger.warning("load of model '%s': %s %s", model, status, body[:300])
        if status == 200 or status is None:  # None: the server is gone
            return status == 200
        time.sleep(1.0)
    return False


def watch(stub_pid: int, model: str, host: str, port: int, server_pid: int) -> None:
    """Read the stub's word (or the end of the pipe), then act on it."""
    word = sys.stdin.buffer.readline().strip()
    if word == CLEAN:
        return
    reloads = reloads_file(server_pid, model)
    if word == RELOAD_AT_START:
        now = time.time()
        recent = recent_reloads_at_start(reloads, now)
        if len(recent) >= MAX_RELOADS_AT_START:
            logger.error("model '%s' failed before its first step after each of its last %d reloads (within %d s): "
                         "unloading it and not reloading it again; load it by hand once the cause is fixed",
                         model, len(recent), RELOAD_WINDOW_S)
            if not process_is_gone(server_pid):
                repository_call(host, port, model, "unload")
            return
        reloads.write_text(json.dumps([*recent, now]))
        logger.warning("model '%s' failed before its first step: reloading it (%d of %d tries)", model,
                       len(recent) + 1, MAX_RELOADS_AT_START)
    elif word == RELOAD:
        reloads.unlink(missing_ok=True)  # it served: a failure at start later counts from zero
        logger.warning("the engine of model '%s' failed: reloading the model", model)
    else:  # the pipe closed without a word: the stub died, or is dying
        if not wait_until_gone(stub_pid, timeout_s=5.0):
            return  # it lives: it closed the pipe on its way out of a normal finalize
        logger.warning("the stub of model '%s' (pid %d) died: reloading the model", model, stub_pid)
    if process_is_gone(server_pid):
        return
    reload_model(host, port, model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stub-pid", type=int, required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="diffulex stub watchdog: %(message)s")
    watch(args.stub_pid, args.model, args.host, args.port, args.server_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
