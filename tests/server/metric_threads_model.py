"""model.py of `metric_threads`: a model that only counts errors in the served model's metrics (ServingMetrics), from
two threads at once while it loads, as the served model's threads do when an engine failure meets arriving requests
(the response thread ends the open ones, Triton's thread refuses the new ones, each counting under "unavailable").
The load ends when both threads are done, and the log says how many errors they counted."""

import threading
import time

import triton_python_backend_utils as pb_utils

SECONDS = 3.0


class TritonPythonModel:
    def initialize(self, args):
        from diffulex_backend.serving.metrics import ServingMetrics

        self.metrics = ServingMetrics(pb_utils.MetricFamily, {"model": args["model_name"]})  # kept: its families stay
        counts = [0, 0]
        stop = time.monotonic() + SECONDS

        def count(thread: int) -> None:
            while time.monotonic() < stop:
                self.metrics.count_errors("unavailable")
                counts[thread] += 1

        threads = [threading.Thread(target=count, args=(thread,)) for thread in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        pb_utils.Logger.log_info(f"metric_threads: {sum(counts)} errors counted")

    def execute(self, requests):
        return None  # decoupled, and sent none

    def finalize(self):
        pass
