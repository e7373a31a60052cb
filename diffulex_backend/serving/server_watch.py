"""Notice that tritonserver is going away while requests are open, so they end with an error at once.

On SIGINT or SIGTERM, Triton 2.51 first stops taking HTTP connections and waits, up to its exit timeout, for the
open ones to close; then it waits for in-flight requests; then it unloads models. A stream outlives all of that:
the model is never told, its clients see their streams cut at the exit timeout with no final response, and the
server exits without unloading the model. Two signs show the model what is happening, and it watches both:
  * the server's readiness: once it stops (or the model is being unloaded), asking whether the model is ready
    fails or says no;
  * the HTTP endpoint: a server that has stopped taking connections resets a new one, where a busy one still
    accepts it. The endpoint is read off the server's command line, and is watched only after it has answered
    once, so a server without HTTP, or one this process cannot reach, is never taken for one that is leaving.
"""

from __future__ import annotations

import http.client
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000
PROBE_TIMEOUT_S = 1.0
RESETS_TO_LEAVE = 2  # one reset could be a hiccup; two in a row, half a second apart, are a server that left


def server_options(server_args: Sequence[str]) -> dict[str, str]:
    """tritonserver's `--name value` and `--name=value` options, by name."""
    options: dict[str, str] = {}
    args = list(server_args)
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            options[name] = value
    return options


def explicit_model_control(server_args: Sequence[str]) -> bool:
    """Whether the server takes load and unload requests through its repository API."""
    return server_options(server_args).get("model-control-mode") == "explicit"


def http_endpoint(server_args: Sequence[str]) -> tuple[str, int] | None:
    """(host, port) of the HTTP endpoint of a tritonserver started with these arguments, or None without one."""
    options = server_options(server_args)
    if options.get("allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    host = options.get("http-address", "0.0.0.0")
    try:
        port = int(options.get("http-port", DEFAULT_HTTP_PORT))
    except ValueError:
        return None
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), port


def parent_server_args(pid: int) -> list[str]:
    """The command line of process `pid` (the stub's parent, tritonserver), or [] when it cannot be read."""
    try:
        return [part.decode(errors="replace") for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if part]
    except OSError:
        return []


class HttpLeaveProbe:
    """Says the server is leaving once its HTTP endpoint, which answered before, resets new connections."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._answered = False
        self._resets = 0

    def server_is_leaving(self) -> bool:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=PROBE_TIMEOUT_S)
        try:
            connection.request("GET", "/v2/health/live")
            connection.getresponse().read()
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected,
                http.client.BadStatusLine):
            self._resets += 1
            return self._answered and self._resets >= RESETS_TO_LEAVE
        except OSError:  # a timeout or an unreachable address says nothing about leaving
            return False
        finally:
            connection.close()
        self._answered, self._resets = True, 0
        return False


class ServerWatch:
    """`server_is_leaving()` for the engine loop, from the model's readiness and the HTTP probe."""

    def __init__(self, model_is_ready: Callable[[], bool], http_probe: HttpLeaveProbe | None):
        self._model_is_ready = model_is_ready
        self._http_probe = http_probe
        self._readiness_usable = True

    def server_is_leaving(self) -> bool:
        if self._readiness_usable:
            try:
                if not self._model_is_ready():
                    return True
            except Exception as err:  # Triton answers "Server not ready" once it is stopping
                if "not ready" in str(err).lower():
                    return True
                logger.warning("asking for the model's readiness failed, so only the HTTP endpoint is watched: %r",
                               err)
                self._readiness_usable = False
        return self._http_probe is not None and self._http_probe.server_is_leaving()
