"""Watch the model's Python stub for its whole life: bring the model back when the stub dies or its engine fails,
through tritonserver's repository API, and end the stub when the server dies under it.

Triton 2.51 never restarts the stub of a decoupled model: once the stub is killed (the kernel's OOM killer, a
fault in native code), every request gets "Stub process ... is not healthy" while every health endpoint still
answers 200, until the server is restarted. So the model starts this watchdog as a child process in its own
session, with a pipe to it, and tells it how things end:
  * "clean" on a normal finalize;
  * "reload" when the engine has failed, or a thread of the model ended: the watchdog reloads the model, which gets
    a fresh process and engine;
  * "reload-at-start" for the same, when the engine had served no step since the load: the watchdog reloads the
    model unless it has done so MAX_RELOADS_AT_START times in the last RELOAD_WINDOW_S seconds already. A model
    that fails before its first step on every load then stays unloaded (not ready), and the log says why, rather
    than being reloaded for ever;
  * nothing (the pipe closes because the stub died): the watchdog reloads the model.
Reloading is unload, then load: the model reports not ready, and new requests get "unknown model", as soon as the
unload is asked; it is back once the load ends. The repository API needs `--model-control-mode=explicit`; under
other modes the model starts the watchdog without an endpoint, and it reloads nothing. Requests that were in flight
when the stub died cannot be answered by anything: Triton 2.51 keeps their streams open, so clients need a timeout
of their own.

When tritonserver itself dies (a crash, SIGKILL), its stub should exit by itself, but Triton 2.51's stub does not
always: it notices its server's death only once the dead process is reaped (a zombie still answers kill(pid, 0)),
and a stub with a request open then hangs in its own teardown, waiting for an answer from the dead server to a call
the model made (a cancellation check, a metric update), while it keeps its memory: on a GPU, memory the restarted
server needs. The stub's parent changes the moment the server dies, so the watchdog reads the stub's parent every
POLL_S seconds; once it is no longer the server, the watchdog gives the stub SERVER_GONE_GRACE_S seconds to exit,
then kills it and removes its shared-memory region, which the dead server can no longer remove.

The reloads at start are counted in a file of the temp folder per server and model (`reloads_file`), which outlives
each watchdog, since each lives for one load only. A watchdog that sees its server gone removes its server's files,
and every watchdog removes, as it starts, the files of servers that are gone, however they ended.

It runs as a script, importing nothing but the standard library, so it costs a few megabytes.

    python stub_watchdog.py --stub-pid PID --server-pid PID --model NAME [--host HOST --port PORT]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import select
import signal
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("diffulex.stub_watchdog")

CLEAN, RELOAD, RELOAD_AT_START = b"clean", b"reload", b"reload-at-start"
LOAD_TIMEOUT_S = 3600  # a large checkpoint loads for minutes
MAX_RELOADS_AT_START = 3
RELOAD_WINDOW_S = 600.0
POLL_S = 0.2  # how often the stub's parent is read
SERVER_GONE_GRACE_S = 1.0  # the time a stub gets to exit by itself once its server is gone
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"  # the stub's second argument names its region


RELOADS_PREFIX = "diffulex-watchdog-"


def reloads_file(server_pid: int, model: str, folder: Path | None = None) -> Path:
    """Where the reloads at start of one model of one server are kept: each watchdog lives for one load only."""
    return Path(folder or tempfile.gettempdir()) / f"{RELOADS_PREFIX}{server_pid}-{model}.json"


def forget_gone_servers(folder: Path | None = None, server_pid: int | None = None) -> None:
    """Remove the reloads files of servers that are gone (of `server_pid` alone, when given): a server's pid names
    its files, and nothing counts its reloads once it has ended."""
    for path in Path(folder or tempfile.gettempdir()).glob(f"{RELOADS_PREFIX}*.json"):
        pid = path.name[len(RELOADS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and (server_pid is None or int(pid) == server_pid) and process_is_gone(int(pid)):
            path.unlink(missing_ok=True)


def recent_reloads_at_start(path: Path, now: float) -> list[float]:
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [t for t in times if isinstance(t, (int, float)) and now - t < RELOAD_WINDOW_S]


def running_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, parent pid, ..., start time the 20th) while the
    process runs; None once it is gone or a zombie (a dead stub stays one until tritonserver reaps it, and
    kill(pid, 0) still answers for it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields if fields[0] not in ("Z", "X") else None


def process_is_gone(pid: int) -> bool:
    return running_stat(pid) is None


class Stub:
    """The watched stub process, known by its pid and start time, so that a pid reused after it is never taken
    for it."""

    def __init__(self, pid: int):
        self.pid = pid
        fields = running_stat(pid)
        self._start = None if fields is None else fields[19]  # None: gone already, never alive

    def _fields(self) -> list[str] | None:
        fields = running_stat(self.pid)
        return fields if fields is not None and fields[19] == self._start else None

    def alive(self) -> bool:
        return self._fields() is not None

    def orphaned(self, server_pid: int) -> bool:
        """Running, and no longer the server's child: the server has died."""
        fields = self._fields()
        return fields is not None and int(fields[1]) != server_pid

    def wait_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def shm_region(self) -> str | None:
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as cmdline:
                region = cmdline.read().split(b"\0")[2].decode()
        except (OSError, IndexError, UnicodeDecodeError):
            return None
        return region if region.startswith(SHM_REGION_PREFIX) and "/" not in region else None


def end_orphaned_stub(stub: Stub, model: str, server_pid: int) -> None:
    """The server is gone: give the stub its grace to exit, then kill it and remove its shared-memory region."""
    if stub.wait_gone(SERVER_GONE_GRACE_S):
        return
    region = stub.shm_region()
    try:
        os.kill(stub.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    logger.error("tritonserver (pid %d) is gone and the stub of model '%s' (pid %d) outlived it by %.1f s: killed "
                 "it, so that it frees its memory", server_pid, model, stub.pid, SERVER_GONE_GRACE_S)
    if region is not None:
        stub.wait_gone(timeout_s=5.0)
        try:
            os.unlink(f"/dev/shm/{region}")
        except OSError:
            pass


def next_word(stub: Stub, server_pid: int) -> bytes | None:
    """The stub's word, b"" when the pipe closes without one, or None when the server dies first."""
    received = b""
    while True:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], POLL_S)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 256)
            received += chunk
            if not chunk or b"\n" in received:
                return received.split(b"\n", 1)[0].strip()
        elif stub.orphaned(server_pid):
            return None


def watch_until_gone(stub: Stub, model: str, server_pid: int) -> None:
    """The rest of the stub's life: end it if the server dies first."""
    while stub.alive():
        if stub.orphaned(server_pid):
            end_orphaned_stub(stub, model, server_pid)
            return
        time.sleep(POLL_S)


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


def act_on(word: bytes, stub: Stub, model: str, server_pid: int, endpoint: tuple[str, int] | None) -> None:
    """Reload the model if the stub's word (or its death) asks for it and the server takes reloads."""
    if word == CLEAN:
        return
    if word not in (RELOAD, RELOAD_AT_START):  # the pipe closed without a word: the stub died, or is dying
        if not stub.wait_gone(timeout_s=5.0):
            return  # it lives: it closed the pipe on its way out of a normal finalize
        if process_is_gone(server_pid):
            return  # the server went first: nothing is left to reload the model into
        if endpoint is None:
            logger.error("the stub of model '%s' (pid %d) died, and the server is not under "
                         "--model-control-mode=explicit: the model cannot come back until it is loaded again", model,
                         stub.pid)
            return
        logger.warning("the stub of model '%s' (pid %d) died: reloading the model", model, stub.pid)
    elif endpoint is None:
        return  # the model has said, in the server's log, that nothing can reload it
    elif word == RELOAD_AT_START:
        reloads = reloads_file(server_pid, model)
        now = time.time()
        recent = recent_reloads_at_start(reloads, now)
        if len(recent) >= MAX_RELOADS_AT_START:
            logger.error("model '%s' failed before its first step after each of its last %d reloads (within %d s): "
                         "unloading it and not reloading it again; load it by hand once the cause is fixed",
                         model, len(recent), RELOAD_WINDOW_S)
            if not process_is_gone(server_pid):
                repository_call(*endpoint, model, "unload")
            return
        reloads.write_text(json.dumps([*recent, now]))
        logger.warning("model '%s' failed before its first step: reloading it (%d of %d tries)", model,
                       len(recent) + 1, MAX_RELOADS_AT_START)
    else:
        reloads_file(server_pid, model).unlink(missing_ok=True)  # it served: a failure at start later counts from 0
        logger.warning("the engine of model '%s' failed: reloading the model", model)
    if process_is_gone(server_pid):
        return
    reload_model(*endpoint, model)


def watch(stub_pid: int, model: str, server_pid: int, endpoint: tuple[str, int] | None) -> None:
    """Wait for the stub's word (or the end of the pipe) and act on it; end the stub if the server dies first, or
    while the stub finishes. Whatever the end, the reloads files of a server that is gone go with it."""
    forget_gone_servers()
    stub = Stub(stub_pid)
    try:
        word = next_word(stub, server_pid)
        if word is None:
            end_orphaned_stub(stub, model, server_pid)
            return
        act_on(word, stub, model, server_pid, endpoint)
        watch_until_gone(stub, model, server_pid)
    finally:
        forget_gone_servers(server_pid=server_pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stub-pid", type=int, required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", help="the server's HTTP endpoint, for reloads (explicit model control only)")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    if (args.host is None) != (args.port is None):
        parser.error("--host and --port go together")
    logging.basicConfig(level=logging.WARNING, format="diffulex stub watchdog: %(message)s")
    endpoint = None if args.host is None else (args.host, args.port)
    watch(args.stub_pid, args.model, args.server_pid, endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
