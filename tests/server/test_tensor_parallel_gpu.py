"""Tensor parallelism on two GPUs through tritonserver: the shipped config with tensor_parallel_size 2 on a KIND_GPU
instance puts rank 0 on its GPU and rank 1 on the next, trades over NCCL, answers what one rank answers, and gives
the second GPU's memory back when it is unloaded. Only a machine of two GPUs runs it (`make gpu-check` there)."""

import pytest
import torch
from served import post, load_shipped, wait_for
from test_demo_answer import additions, answers

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")

MODEL = "diffulex_demo_tensor_parallel"
GIB = 2**30


def used(gpu: int) -> int:
    free, total = torch.cuda.mem_get_info(gpu)
    return total - free


def test_two_gpus_answer_as_one_does_and_unloading_frees_the_second(server):
    before = used(1)
    load_shipped(server, MODEL, instance_group="[{ kind: KIND_GPU, count: 1, gpus: [0] }]", tensor_parallel_size=2)
    try:
        # Rank 1 holds its share of the weights and of the KV cache, sized from what GPU 1 has free.
        assert used(1) - before > GIB
        problems = additions(12)
        assert answers(server, MODEL, problems) == {prompt: (answer, "stop") for prompt, answer in problems}
    finally:
        status, payload = post(f"{server.http_url}/v2/repository/models/{MODEL}/unload", {})
    assert status == 200, payload
    wait_for(lambda: used(1) - before < GIB / 4, timeout_s=60)
