"""Tensor parallelism through tritonserver: the model instance's stub starts its ranks' processes, serves the
tokens of one rank, reports a dead rank by name and comes back in a fresh process, and leaves no rank behind when
it is unloaded."""

import json
import os
import signal
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from processes import alive, live_children
from served import generate, ids, post, stub_pids, wait_for
from triton_server import TENSOR_PARALLEL_SETTINGS

from diffulex_backend import Diffulex, SamplingParams

MODEL = "diffulex_tensor_parallel"
PROMPTS = ["the quick brown fox", "tensor parallel ranks"]
PARAMS = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def rank_pids(stub: int) -> list[int]:
    """The stub's children that run a rank (the watchdog is the other child)."""
    return [p for p in live_children(stub) if b"diffulex_backend.workers" in Path(f"/proc/{p}/cmdline").read_bytes()]


def ask(server, prompt: str) -> list[int]:
    return ids(generate(server, {"text_input": prompt, "parameters": PARAMS, "exclude_input_in_output": True},
                        model=MODEL)["output_ids"])


@pytest.fixture(scope="module")
def one_rank(checkpoint):
    settings = {k: v for k, v in TENSOR_PARALLEL_SETTINGS.items() if k != "tensor_parallel_size"}
    engine = Diffulex(str(checkpoint), **settings)
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(**PARAMS))]


def test_two_ranks_serve_the_tokens_of_one_and_a_dead_rank_reloads_the_model(server, one_rank):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model(MODEL)
        try:
            (stub,) = stub_pids(server, MODEL)
            (rank,) = rank_pids(stub)
            assert [ask(server, p) for p in PROMPTS] == one_rank

            os.kill(rank, signal.SIGKILL)
            wait_for(lambda: not alive(rank))
            status, payload = post(f"{server.http_url}/v2/models/{MODEL}/generate",
                                   {"text_input": PROMPTS[0], "parameters": PARAMS})
            assert (status, json.loads(payload)["error"]) == (
                400, "the engine failed and this model can no longer serve: RankFailure: tensor-parallel rank 1 "
                     f"(pid {rank}) exited with signal SIGKILL")
            # The watchdog reloads the model: a fresh stub, with ranks of its own, serving the same tokens.
            wait_for(lambda: stub_pids(server, MODEL) not in ([], [stub]) and client.is_model_ready(MODEL),
                     timeout_s=120)
            (new_stub,) = stub_pids(server, MODEL)
            new_ranks = rank_pids(new_stub)
            assert len(new_ranks) == 1 and not alive(stub)
            assert [ask(server, p) for p in PROMPTS] == one_rank
        finally:
            client.unload_model(MODEL)
            wait_for(lambda: not stub_pids(server, MODEL), timeout_s=60)
    # Unloading ends the stub and its rank.
    wait_for(lambda: not alive(new_stub) and not any(alive(p) for p in new_ranks))
