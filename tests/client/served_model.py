"""Reaching the test server: its address per protocol, and the KV-pages gauge on its metrics port."""

import re
import time
import urllib.request

# The served model's gauge of KV pages held by requests (diffulex_backend/serving/metrics.py); the model has one
# instance, so one series, whatever its other labels.
KV_PAGES_USED = re.compile(r'^diffulex_kv_pages_used\{[^}]*\bmodel="diffulex"[^}]*\} (\S+)$', re.M)


def url_for(server, protocol: str) -> str:
    """host:port, as the client takes it."""
    return server.grpc_url if protocol == "grpc" else server.http_url.removeprefix("http://")


def kv_pages_used(server) -> int:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        match = KV_PAGES_USED.search(response.read().decode())
    assert match, "the server exports no diffulex_kv_pages_used gauge"
    return int(float(match.group(1)))


def wait_for_kv_pages_used(server, expected: int, timeout_s: float = 10.0) -> int:
    """The gauge once it reads `expected`, or its last value when the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while (used := kv_pages_used(server)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return used
