"""The signs of a server that is going away, read without a server: its HTTP endpoint from its command line, a
reset connection after an answered one, and its readiness."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from diffulex_backend.serving.server_watch import HttpLeaveProbe, ServerWatch, explicit_model_control, http_endpoint


@pytest.mark.parametrize("args, endpoint", [
    ([], ("127.0.0.1", 8000)),
    (["--model-repository", "r", "--http-port", "9100"], ("127.0.0.1", 9100)),
    (["--http-port=9100", "--http-address=127.0.0.2"], ("127.0.0.2", 9100)),
    (["--http-address", "0.0.0.0", "--http-port", "8010"], ("127.0.0.1", 8010)),
    (["--allow-http", "false"], None),
    (["--allow-http=0"], None),
    (["--http-port", "eighty"], None),
])
def test_the_http_endpoint_is_read_off_the_server_command_line(args, endpoint):
    assert http_endpoint(["tritonserver", *args]) == endpoint


class Live(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the name http.server calls)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def resetting_listener() -> tuple[socket.socket, threading.Thread]:
    """A listener that resets every connection, as Triton's HTTP endpoint does once it stops taking them."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_the_probe_says_leaving_after_two_resets_of_an_endpoint_that_answered():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Live)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    probe = HttpLeaveProbe("127.0.0.1", port)
    assert probe.server_is_leaving() is False
    server.shutdown()
    server.server_close()
    listener = socket.create_server(("127.0.0.1", port))  # the same port now resets every connection
    listener.close()
    listener, _ = resetting_listener()
    probe.port = listener.getsockname()[1]
    assert [probe.server_is_leaving(), probe.server_is_leaving()] == [False, True]
    listener.close()


def test_an_endpoint_that_never_answered_is_never_taken_for_a_leaving_server():
    listener, _ = resetting_listener()
    probe = HttpLeaveProbe("127.0.0.1", listener.getsockname()[1])
    assert not any(probe.server_is_leaving() for _ in range(4))
    listener.close()


def test_readiness_that_turns_false_or_fails_as_not_ready_means_leaving():
    answers = iter([True, False])
    assert [ServerWatch(lambda: next(answers), None).server_is_leaving() for _ in range(1)] == [False]

    def stopping():
        raise RuntimeError("Server not ready")

    assert ServerWatch(stopping, None).server_is_leaving() is True


def test_readiness_that_cannot_be_asked_is_set_aside_for_the_http_probe():
    def unsupported():
        raise RuntimeError("no model loader in this server")

    watch = ServerWatch(unsupported, None)
    assert watch.server_is_leaving() is False
    assert watch.server_is_leaving() is False


@pytest.mark.parametrize("args, explicit", [
    (["--model-control-mode=explicit", "--load-model=diffulex"], True),
    (["--model-control-mode", "explicit"], True),
    (["--model-control-mode", "poll"], False),
    ([], False),
])
def test_explicit_model_control_is_read_off_the_server_command_line(args, explicit):
    assert explicit_model_control(["tritonserver", *args]) is explicit
