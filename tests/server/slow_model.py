"""model.py of `diffulex_slow`: the shipped adapter over an engine whose every step sleeps, so that streams stay open
long enough for a test to shut the server down or unload the model under them."""

import time

import triton_python_backend_utils as pb_utils

STEP_DELAY_S = 0.5


class TritonPythonModel:
    def initialize(self, args):
        from diffulex_backend.serving.triton_adapter import TritonAdapter

        self.adapter = TritonAdapter(pb_utils, args)
        engine = self.adapter._engine
        step = engine.step_deltas  # the served loop's step

        def slow_step():
            time.sleep(STEP_DELAY_S)
            return step()

        engine.step_deltas = slow_step  # before any request can reach the decoding thread

    def execute(self, requests):
        self.adapter.execute(requests)
        return None

    def finalize(self):
        self.adapter.finalize()
