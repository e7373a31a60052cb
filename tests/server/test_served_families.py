"""Every family and every decoding strategy served through a real tritonserver, with config.pbtxt's defaults (device
auto, so the GPU where there is one) and with an instance placed by instance_group: at batch 1, greedy, the served
tokens equal the in-process engine's with the same settings. The models have head size 64, which the Triton kernels
take, so on a GPU this is the path users run: fused kernels, CUDA graphs, the engine loop's threads on that GPU. On a
CPU the same requests check the same contract in float32."""

import json
from pathlib import Path

import pytest
import torch
from families import MODELS, model_settings, write_adapter, write_checkpoint
from served import ids, post
from triton_server import STARTUP_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, TritonServer, add_model

from diffulex_backend import Diffulex, SamplingParams

# Small blocks so that a short answer spans several; a fixed KV cache, because sizing it from free GPU memory
# assumes one engine per GPU and this server holds one per model; few requests, so the warm-up is short.
SETTINGS = {"block_size": 4, "page_size": 4, "buffer_size": 2, "max_model_len": 256, "num_kv_pages": 256,
            "max_num_reqs": 4}
GPU_GROUP = "[{ kind: KIND_GPU, count: 1, gpus: [0] }]"
CPU_GROUP = "[{ kind: KIND_CPU, count: 1 }]"
PROMPT = list(range(3, 43))  # 40 tokens: ten pages, so that retention has pages to drop
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    families = {family for family, _, _ in MODELS.values()}
    paths = {family: write_checkpoint(root / family, family) for family in families}
    paths["adapter"] = write_adapter(root / "adapter", paths["llada"])
    return paths


def engine_settings(name: str, checkpoints: dict[str, Path]) -> dict:
    return {**SETTINGS, **model_settings(name, checkpoints["adapter"])}


@pytest.fixture(scope="module")
def families_server(tmp_path_factory, checkpoints):
    repository = tmp_path_factory.mktemp("families_repository")
    for name, (family, _, _) in MODELS.items():
        group = None
        if name.endswith("_placed"):
            group = GPU_GROUP if torch.cuda.is_available() else CPU_GROUP
        add_model(repository, name, model=checkpoints[family], instance_group=group,
                  **engine_settings(name, checkpoints))
    loads = [f"--load-model={name}" for name in MODELS]
    # A log of its own: the session's server writes repository.parent / "tritonserver.log".
    server = TritonServer(repository, repository.parent / "families-tritonserver.log",
                          ("--model-control-mode=explicit", *loads))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop(SHUTDOWN_TIMEOUT_S)
        raise
    yield server
    assert server.stop(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()


def as_config_value(value) -> object:
    """A config.pbtxt string as the engine takes it in Python."""
    return {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value


@pytest.mark.parametrize("name", list(MODELS))
def test_each_family_and_strategy_serves_the_in_process_engines_tokens(families_server, checkpoints, name):
    family, _, request = MODELS[name]
    params = {**GREEDY, **request}
    status, payload = post(f"{families_server.http_url}/v2/models/{name}/generate",
                           {"input_ids": PROMPT, "parameters": params, "return_finish_reason": True})
    assert status == 200, payload
    served = json.loads(payload)
    settings = {key: as_config_value(value) for key, value in engine_settings(name, checkpoints).items()}
    engine = Diffulex(str(checkpoints[family]), **settings)
    try:
        (expected,) = engine.generate([PROMPT], SamplingParams(**params))
    finally:
        engine.close()
    assert ids(served["output_ids"]) == expected.token_ids
    assert served["finish_reason"] == "length"
