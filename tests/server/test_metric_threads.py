"""Two threads of the served model that update one metric at once leave tritonserver running and every update
counted. In Triton 2.51's Python backend such updates, unserialized, free a message in shared memory that the server
is still reading, and the server process dies (SIGSEGV): an engine failure that met arriving requests did so, its
response thread and Triton's thread each counting an error under "unavailable" (docs/reliability.md). A server of its
own, whose model counts from two threads for three seconds while it loads."""

import re
import urllib.request
from pathlib import Path

from processes import kill_with_children
from triton_server import SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, TritonServer, add_model


def test_two_threads_counting_one_error_cause_at_once_keep_the_server_up_and_every_count(tmp_path):
    repository = tmp_path / "repository"
    add_model(repository, "metric_threads", Path(__file__).parent / "metric_threads_model.py")
    server = TritonServer(repository, tmp_path / "tritonserver.log",
                          ("--model-control-mode=explicit", "--load-model=metric_threads"))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)  # raises, with the log, if the server died while the model loaded
        counted = re.search(r"metric_threads: (\d+) errors counted", server.log_tail(200000))
        assert counted, server.log_tail()
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        values = [float(value) for labels, value in
                  re.findall(r"^diffulex_request_errors_total\{([^}]*)\} (\S+)$", text, flags=re.M)
                  if 'cause="unavailable"' in labels and 'model="metric_threads"' in labels]
        assert values == [int(counted.group(1))]
        assert values[0] > 100  # the threads overlapped for three seconds, not for a few updates
        assert server.stop(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()
    finally:
        if server.process.poll() is None:
            kill_with_children(server.process)
