"""model.py of the `diffulex_dying_*` test models: the shipped adapter, with one of the engine loop's threads made to
end the way no `except Exception` catches, as a fault of ours in the loop would. The model's name says which:
  * `diffulex_dying_at_start`: the decoding thread fails while it sets itself up;
  * `diffulex_dying_decoder`: the decoding thread ends in its second step, mid-stream;
  * `diffulex_dying_responder`: the response thread ends on the first tokens it delivers, mid-stream."""

import triton_python_backend_utils as pb_utils


class ThreadKilled(BaseException):
    pass


class DyingCounter:
    def increment(self, value):
        raise ThreadKilled("killed while counting")


class TritonPythonModel:
    def initialize(self, args):
        from diffulex_backend.serving.engine_loop import EngineLoop
        from diffulex_backend.serving.triton_adapter import TritonAdapter

        name = args["model_name"]
        if name.endswith("_at_start"):
            def enter_device(loop):
                raise ThreadKilled("killed while setting up")

            EngineLoop._enter_device = enter_device
        self.adapter = TritonAdapter(pb_utils, args)
        if name.endswith("_decoder"):
            engine, step = self.adapter._engine, self.adapter._engine.step_deltas  # the served loop's step
            steps = []

            def dying_step():
                steps.append(1)
                if len(steps) == 2:
                    raise ThreadKilled("killed mid-step")
                return step()

            engine.step_deltas = dying_step
        elif name.endswith("_responder"):
            self.adapter._metrics.generation_tokens = DyingCounter()

    def execute(self, requests):
        self.adapter.execute(requests)
        return None

    def finalize(self):
        self.adapter.finalize()
