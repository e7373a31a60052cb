"""The OpenAI front against the session's tritonserver (tests/conftest.py): one front on the tiny random model
`diffulex`, with an API key, and one on the shipped demo model, loaded under its own name, for chat."""

import signal

import openai
import pytest
import tritonclient.http as httpclient
from diffulex_client.perf.front_process import FrontProcess
from front_requests import API_KEY, DEMO_CHECKPOINT, DEMO_MODEL
from google.protobuf import json_format, text_format
from triton_server import SHIPPED_MODEL, with_parameters
from tritonclient.grpc import model_config_pb2


@pytest.fixture(scope="session")
def front(server, tmp_path_factory):
    process = FrontProcess(server.grpc_url, "diffulex", tmp_path_factory.mktemp("front") / "front.log",
                           "--api-key", API_KEY, "--max-body-bytes", "200000")
    try:
        process.wait_listening()
    except BaseException:
        process.stop()
        raise
    yield process
    # uvicorn ends by re-raising the SIGTERM it handled, once its shutdown is complete.
    assert process.stop() in (0, -signal.SIGTERM), process.log_tail()
    assert "Application shutdown complete" in process.log_tail()


@pytest.fixture(scope="session")
def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def demo_front(server, tmp_path_factory):
    """The shipped config and model.py with the shipped demo checkpoint, behind a front that reads its template."""
    triton = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    config_text = with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), DEMO_MODEL, model=DEMO_CHECKPOINT)
    config = json_format.MessageToJson(text_format.Parse(config_text, model_config_pb2.ModelConfig()))
    triton.load_model(DEMO_MODEL, config=config,
                      files={"file:1/model.py": (SHIPPED_MODEL / "1" / "model.py").read_bytes()})
    process = FrontProcess(server.grpc_url, DEMO_MODEL, tmp_path_factory.mktemp("demo_front") / "front.log",
                           "--tokenizer", str(DEMO_CHECKPOINT))
    try:
        process.wait_listening()
        yield process
    finally:
        process.stop()
        triton.unload_model(DEMO_MODEL)


@pytest.fixture(scope="session")
def demo_client(demo_front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{demo_front.url}/v1", api_key="unused", max_retries=0, timeout=120)

