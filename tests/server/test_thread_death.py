"""A thread of the served model that ends without being told to: every client gets an error that names the cause,
the model turns not ready within seconds, and the watchdog brings it back in a fresh process. The test models
(dying_thread_model.py) end one thread each, the way no `except Exception` catches."""

import time

import pytest
import tritonclient.grpc as grpcclient
from served import grpc_inputs, grpc_stream, stub_pids, wait_for
from tritonclient.utils import InferenceServerException

LONG = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}


def wait_not_ready(client, model: str, timeout_s: float) -> float:
    """Seconds until the model reports not ready, polled every 20 ms (a reload of the tiny model takes seconds)."""
    started = time.monotonic()
    while client.is_model_ready(model):
        assert time.monotonic() - started < timeout_s, f"{model} still ready after {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("model, message", [
    ("diffulex_dying_decoder",
     "the decoding thread stopped and this model can no longer serve: ThreadKilled: killed mid-step"),
    ("diffulex_dying_responder",
     "the response thread stopped and this model can no longer serve: ThreadKilled: killed while counting"),
])
def test_a_thread_that_dies_mid_stream_ends_the_stream_and_the_model_comes_back(server, model, message):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model(model)
        (first_stub,) = stub_pids(server, model)
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as caught:
            grpc_stream(server, grpc_inputs("hello", LONG, stream=True), model=model)
        assert caught.value.message() == message
        assert time.monotonic() - started < 30  # answered, not left to a client's timeout
        assert wait_not_ready(client, model, timeout_s=5) < 5
        wait_for(lambda: stub_pids(server, model) not in ([], [first_stub]) and client.is_model_ready(model),
                 timeout_s=120)
        # The fresh process serves again, until its thread ends the same way.
        with pytest.raises(InferenceServerException) as caught:
            grpc_stream(server, grpc_inputs("hello again", LONG, stream=True), model=model)
        assert caught.value.message() == message
        client.unload_model(model)
    assert f"{model}: thread_death: {message}" in server.log_tail(200000)


def test_a_decoding_thread_that_cannot_start_fails_the_load_with_its_cause(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("diffulex_dying_at_start")
        assert "the decoding thread could not start: ThreadKilled: killed while setting up" in caught.value.message()
        assert not client.is_model_ready("diffulex_dying_at_start")
        assert client.is_model_ready("diffulex")
    time.sleep(3)  # a watchdog that reloaded what never loaded would have logged it by now
    assert "model 'diffulex_dying_at_start'" not in server.log_tail(200000)
