"""What `make serve` runs, as it runs it: tritonserver on the repository's own model_repository folder, the shipped
config.pbtxt untouched (device auto: the GPU where there is one, with its memory sized by gpu_memory_utilization).
The demo model answers, with the in-process engine's tokens."""

import json

import torch

from google.protobuf import json_format, text_format
from served import ids, post
from triton_server import SHIPPED_MODEL, SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, TritonServer
from tritonclient.grpc import model_config_pb2

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.serving.engine_settings import engine_settings


def test_the_shipped_repository_serves_the_in_process_engines_answer(tmp_path):
    config = text_format.Parse((SHIPPED_MODEL / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    parameters = json_format.MessageToDict(config, preserving_proto_field_name=True)["parameters"]  # as Triton hands them to the model
    settings = engine_settings(parameters, model_dir=SHIPPED_MODEL)
    # The reference takes a small cache: the served model sizes its own from the GPU memory it is given.
    engine = Diffulex(settings.pop("model"), **{**settings, "num_kv_pages": 64})
    prompts = ["12+34=", "7+8="]
    try:
        expected = engine.generate(prompts, SamplingParams())
    finally:
        engine.close()
        del engine
        if torch.cuda.is_available():  # the served model sizes its cache from the memory left free
            torch.cuda.empty_cache()
    server = TritonServer(SHIPPED_MODEL.parent, tmp_path / "tritonserver.log",
                          ("--model-control-mode=explicit", "--load-model=diffulex"))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        for prompt, reference in zip(prompts, expected):
            status, payload = post(f"{server.http_url}/v2/models/diffulex/generate",
                                   {"text_input": prompt, "exclude_input_in_output": True})
            assert status == 200, payload
            answer = json.loads(payload)
            assert (ids(answer["output_ids"]), answer["text_output"]) == (reference.token_ids, reference.text)
        assert [out.text for out in expected] == ["46", "15"]
    finally:
        assert server.stop(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()
