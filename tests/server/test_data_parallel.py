"""Data parallelism: each model instance of an instance_group is a stub process with an engine of its own, on the
device Triton places it on, with metrics of its own. The test model's two instances are KIND_CPU ones on a machine
without a GPU, and KIND_GPU ones on a GPU machine (triton_server.data_parallel_group)."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import tritonclient.grpc as grpcclient
from served import generate, ids, reference, stub_pids, wait_for
from triton_server import DATA_PARALLEL_SETTINGS, data_parallel_group

from diffulex_backend.serving.engine_settings import on_instance_device

MODEL = "diffulex_data_parallel"
INSTANCES = {(MODEL + suffix, device) for suffix, device in data_parallel_group(torch.cuda.device_count())[1]}
PROMPTS = [f"request {i}: the quick brown fox" for i in range(8)]
PARAMS = {"max_tokens": 4, "temperature": 0}
MAX_ROUNDS = 8
# The gauges and counters each engine sets (diffulex_backend/serving/metrics.py).
SERIES = ["diffulex_prompt_tokens_total", "diffulex_generation_tokens_total", "diffulex_num_requests_running",
          "diffulex_num_requests_waiting", "diffulex_num_requests_preempted", "diffulex_kv_pages_used",
          "diffulex_kv_pages_free", "diffulex_prefix_cache_hit_ratio"]


def series_by_instance(server, name: str, model: str = MODEL) -> dict[tuple[str, str], float]:
    """Each series of metric `name` for `model`, keyed by its (model_instance, device) labels."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, flags=re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if label.get("model") == model:
            found[label.get("model_instance"), label.get("device")] = float(value)
    return found


def test_two_instances_are_two_engines_that_each_serve_the_engine_tokens_with_metrics_of_their_own(server, engine):
    expected = [output.token_ids for output in reference(engine, PROMPTS, **PARAMS)]
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model(MODEL)
        try:
            assert len(stub_pids(server, MODEL)) == 2  # a process, so an engine, per instance

            def ask(prompt):
                return ids(generate(server, {"text_input": prompt, "parameters": PARAMS,
                                             "exclude_input_in_output": True}, model=MODEL)["output_ids"])

            # Triton gives each batch of waiting requests to a free instance: concurrent requests reach both.
            # Rounds go on until both have served some, or fail after MAX_ROUNDS.
            sent_tokens = 0
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                for _ in range(MAX_ROUNDS):
                    assert list(pool.map(ask, PROMPTS)) == expected
                    sent_tokens += sum(map(len, expected))
                    served = series_by_instance(server, "diffulex_generation_tokens_total")
                    if len(served) == 2 and all(served.values()):
                        break
            wait_for(lambda: sum(series_by_instance(server, "diffulex_generation_tokens_total").values()) == sent_tokens)
            served = series_by_instance(server, "diffulex_generation_tokens_total")
            assert set(served) == INSTANCES and all(tokens > 0 for tokens in served.values()), served
            for name in SERIES:
                assert set(series_by_instance(server, name)) == set(served), name
            # Each engine has a KV cache of its own, all free again.
            wait_for(lambda: set(series_by_instance(server, "diffulex_kv_pages_free").values())
                     == {DATA_PARALLEL_SETTINGS["num_kv_pages"]})
        finally:
            client.unload_model(MODEL)
            wait_for(lambda: not stub_pids(server, MODEL), timeout_s=60)


# ---- where each instance's engine runs ------------------------------------------------------------------------
@pytest.mark.parametrize("device", [None, "auto", "cuda", "cuda:3"])
def test_a_gpu_instance_runs_its_engine_on_the_gpu_triton_gives_it(device):
    settings = {"model": "ckpt", "block_size": 4} | ({} if device is None else {"device": device})
    assert on_instance_device(settings, "GPU", 3) == {"model": "ckpt", "block_size": 4, "device": "cuda:3"}


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_device_that_contradicts_the_instance_group_fails_the_load_naming_both(device):
    with pytest.raises(ValueError) as caught:
        on_instance_device({"model": "ckpt", "device": device}, "GPU", 3)
    assert f"parameter 'device' in config.pbtxt is '{device}'" in str(caught.value)
    assert "on GPU 3 ('cuda:3')" in str(caught.value)


@pytest.mark.parametrize("kind", ["CPU", "MODEL"])
@pytest.mark.parametrize("device", [None, "auto", "cpu", "cuda:1"])
def test_cpu_and_model_instances_keep_the_device_setting(kind, device):
    settings = {"model": "ckpt"} | ({} if device is None else {"device": device})
    assert on_instance_device(settings, kind, 0) == settings
