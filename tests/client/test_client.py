"""DiffulexClient and AsyncDiffulexClient against the real server, over gRPC and HTTP."""

import asyncio
import json

import pytest
import torch
from served_model import kv_pages_used, url_for, wait_for_kv_pages_used
from triton_server import free_ports

from diffulex_backend import SamplingParams
from diffulex_backend.flash_attention import refusal
from diffulex_kernels.attention import HEAD_DIMS
from diffulex_client import (
    AsyncDiffulexClient,
    Completion,
    DiffulexClient,
    DiffulexConnectionError,
    DiffulexServerError,
    DiffulexTimeoutError,
)

PROMPT = "The quick brown fox"
# Four blocks of the served model's block_size (4): a streamed request gets several responses.
SHORT = {"max_tokens": 16, "ignore_eos": True}
# Long enough that the request is still decoding when a test closes its stream after the first delta.
LONG = {"max_tokens": 400, "ignore_eos": True}


def test_generate_returns_what_the_engine_generates(client, engine):
    reference = engine.generate(PROMPT, SamplingParams(**SHORT))[0]
    assert client.generate(PROMPT, **SHORT) == Completion(
        text=reference.text, finish_reason=reference.finish_reason.value,
        num_input_tokens=len(reference.prompt_token_ids), num_output_tokens=len(reference.token_ids),
        nfe=reference.nfe)


def test_stream_deltas_concatenate_to_the_generated_text(client):
    completion = client.generate(PROMPT, **SHORT)
    with client.stream(PROMPT, **SHORT) as stream:
        deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(deltas) == completion.text
    assert stream.completion == completion


def test_async_client_matches_the_sync_client(client, async_client):
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    expected = [client.generate(prompt, **SHORT) for prompt in prompts]

    async def run():
        completions = await asyncio.gather(*(async_client.generate(prompt, **SHORT) for prompt in prompts))
        async with async_client.stream(prompts[0], **SHORT) as stream:
            deltas = [delta async for delta in stream]
        return completions, deltas, stream.completion

    completions, deltas, streamed = asyncio.run(run())
    assert completions == expected
    assert len(deltas) > 1 and "".join(deltas) == expected[0].text
    assert streamed == expected[0]


def test_closing_a_stream_early_cancels_the_request_and_frees_its_pages(server, client):
    assert wait_for_kv_pages_used(server, 0) == 0
    stream = client.stream(PROMPT, **LONG)
    next(stream)
    assert kv_pages_used(server) > 0
    stream.close()
    assert wait_for_kv_pages_used(server, 0) == 0
    assert stream.completion is None
    assert client.generate(PROMPT, **SHORT).num_output_tokens == SHORT["max_tokens"]


def test_async_stream_closed_early_frees_its_pages(server, async_client):
    assert wait_for_kv_pages_used(server, 0) == 0

    async def first_delta_then_close():
        stream = async_client.stream(PROMPT, **LONG)
        await anext(stream)
        used_while_running = kv_pages_used(server)
        await stream.aclose()
        return used_while_running

    assert asyncio.run(first_delta_then_close()) > 0
    assert wait_for_kv_pages_used(server, 0) == 0


def test_a_timed_out_request_raises_and_is_cancelled(server, protocol):
    client = DiffulexClient(url_for(server, protocol), protocol, timeout=0.5)
    with pytest.raises(DiffulexTimeoutError):
        client.generate(PROMPT, **LONG)
    assert wait_for_kv_pages_used(server, 0) == 0


def test_server_error_carries_the_servers_message(client):
    with pytest.raises(DiffulexServerError) as error:
        client.generate(PROMPT, bogus=1)
    assert error.value.message == (
        f"input 'sampling_parameters': unknown sampling parameter(s) ['bogus']; "
        f"allowed: {SamplingParams.field_names()}")
    with pytest.raises(DiffulexServerError, match=r"exceeds max_model_len \(512\)$"):
        next(client.stream(PROMPT, max_tokens=1000))


def test_async_server_error_carries_the_servers_message(async_client):
    with pytest.raises(DiffulexServerError, match=r"unknown sampling parameter\(s\) \['bogus'\]"):
        asyncio.run(async_client.generate(PROMPT, bogus=1))


def test_unreachable_server_raises_connection_error(protocol):
    url = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    with pytest.raises(DiffulexConnectionError):
        DiffulexClient(url, protocol).generate(PROMPT)
    with pytest.raises(DiffulexConnectionError):
        asyncio.run(AsyncDiffulexClient(url, protocol).generate(PROMPT))
    with pytest.raises(DiffulexConnectionError):
        DiffulexClient(url, protocol).health()


def test_health_reports_readiness_and_the_engine_settings_as_loaded(client, checkpoint):
    health = client.health()
    assert health.ok
    # The test server's config.pbtxt: the shipped one with these parameters replaced.
    assert {name: health.engine_settings[name] for name in ("model", "block_size", "page_size", "buffer_size")} \
        == {"model": str(checkpoint), "block_size": "4", "page_size": "4", "buffer_size": "2"}
    assert health.engine_settings["decoding_strategy"] == "multi_bd"


def test_health_reports_the_settings_the_engine_resolved(client, server, checkpoint):
    """config.pbtxt says `auto` or nothing; each instance's engine says what it chose."""
    assert client.health(server.metrics_url).engine_settings["device"] == "auto"
    (instance, settings), = client.health(server.metrics_url).resolved_settings.items()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert instance.endswith(f"({device})")
    # auto takes the Triton kernels on a GPU for the head sizes they serve.
    config = json.loads((checkpoint / "config.json").read_text())  # LLaDA's keys
    head_dim = config["d_model"] // config["n_heads"]
    kernels = device != "cpu" and head_dim in HEAD_DIMS
    # and flash-attn for prompts where it is installed and serves the model (flash_attention.refusal)
    flash = kernels and refusal(torch.cuda.get_device_capability(), torch.bfloat16, (head_dim,), False) is None
    assert {name: settings[name] for name in ("device", "dtype", "block_size", "model", "decoding_strategy",
                                               "attention_backend")} == {
        "device": device, "dtype": "bfloat16" if device != "cpu" else "float32", "block_size": "4",
        "model": str(checkpoint), "decoding_strategy": "multi_bd", "attention_backend": "flash_attn" if flash else "triton" if kernels else "torch"}
    assert int(settings["num_kv_pages"]) > 0 and settings["max_model_len"] == "512"
    assert int(settings["mask_token_id"]) >= 0  # unset in config.pbtxt: resolved from the checkpoint


def test_health_of_an_unknown_model_is_not_ready(server, protocol):
    health = DiffulexClient(url_for(server, protocol), protocol, model="no_such_model").health()
    assert health.server_live and health.server_ready
    assert not health.model_ready and not health.ok
    assert health.engine_settings == {}
