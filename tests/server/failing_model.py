"""model.py of `diffulex_failing`: the shipped adapter over an engine whose every step raises, to drive the
fatal-error path through a real server (open requests end with an error, the model is reloaded)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        from diffulex_backend.serving.triton_adapter import TritonAdapter

        self.adapter = TritonAdapter(pb_utils, args)

        def step_deltas():
            raise RuntimeError("device lost")

        self.adapter._engine.step_deltas = step_deltas  # the served loop's step; before any request can reach the decoding thread

    def execute(self, requests):
        self.adapter.execute(requests)
        return None

    def finalize(self):
        self.adapter.finalize()
