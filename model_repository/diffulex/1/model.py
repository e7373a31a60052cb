"""The diffulex model: Triton's entry points, delegated to diffulex_backend.serving.triton_adapter.

initialize builds the engine from config.pbtxt's parameters and starts the engine loop (a decoding thread
and a response thread); execute hands each request over and returns at once, since responses are sent
from the loop (decoupled); finalize stops the loop and ends open requests with UNAVAILABLE.
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # Imported here rather than at the top: the server also imports this file in a short-lived process
        # to auto-complete the config, and the engine's imports (torch, transformers) take seconds.
        from diffulex_backend.serving.triton_adapter import TritonAdapter

        self.adapter = TritonAdapter(pb_utils, args)

    def execute(self, requests):
        self.adapter.execute(requests)
        return None

    def is_ready(self):
        """Asked by Triton releases that support model-defined readiness: false once the engine has failed."""
        return self.adapter.is_ready()

    def finalize(self):
        self.adapter.finalize()
