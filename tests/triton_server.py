"""The test suites' tritonserver: the project's launcher (diffulex_client.perf.tritonserver), the one `make serve`
runs (tools/serve.py), the served test model's settings, and model repositories built from the shipped model."""

import importlib.util
import re
import shutil
from pathlib import Path

import torch

from diffulex_client.perf.tritonserver import (
    LAUNCHER, LOOPBACK, SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, TritonServer, free_ports, wait_until_ready)

__all__ = ["BAD_SETTINGS", "LAUNCHER", "LOOPBACK", "SHIPPED_MODEL", "SHUTDOWN_TIMEOUT_S", "STARTUP_TIMEOUT_S",
           "TEST_SETTINGS", "DATA_PARALLEL_SETTINGS", "FAST_DLLM_V2_SETTINGS", "TENSOR_PARALLEL_SETTINGS",
           "SERVE_LAUNCHER", "TritonServer", "add_model", "data_parallel_group", "free_ports", "serve_launcher",
           "wait_until_ready", "with_backend_parameters", "with_instance_group", "with_parameters"]

# The served test model's engine settings: small blocks, so that short outputs span several. The in-process
# reference engine uses the same. On a GPU the KV cache has a fixed size (sized from free memory, the first engine on
# the GPU would take nearly all of it and leave none for the others and the in-process reference), and a batch holds
# at most 16 requests, so that each load warms up five batch sizes rather than seven.
ON_GPU = {"num_kv_pages": 4096, "max_num_reqs": 16} if torch.cuda.is_available() else {}
TEST_SETTINGS = {"block_size": 4, "page_size": 4, "buffer_size": 2, "max_model_len": 512, **ON_GPU}
# Fast-dLLM v2's model: blocks of 8 decoded in sub-blocks of 4, a low threshold so that sub-blocks take several tokens.
FAST_DLLM_V2_SETTINGS = {"decoding_strategy": "fast_dllm_v2", "block_size": 8, "sub_block_size": 4, "page_size": 4,
                         "accept_threshold": 0.3, "max_model_len": 512, **ON_GPU}

# The data-parallel model's: the test model's, with a KV cache of fixed size, because sizing it from free GPU memory
# assumes one engine per GPU, and on a machine of one GPU both instances share it.
DATA_PARALLEL_SETTINGS = {**TEST_SETTINGS, "num_kv_pages": 1024}
# The tensor-parallel model's: the test model's over two ranks, in float64 on the CPU so that its tokens equal one
# rank's (float32 sums in another order could flip a near tie).
TENSOR_PARALLEL_SETTINGS = {**TEST_SETTINGS, "tensor_parallel_size": 2, "dtype": "float64", "device": "cpu"}

# A setting of each class the model's load refuses by name, as config.pbtxt gives it, over the shipped settings
# (buffer_size 1), and the message's start.
BAD_SETTINGS = {
    "digit_separator": ({"block_size": "1_000"},
                        "parameter 'block_size' in config.pbtxt must be an integer, got '1_000'"),
    "other_digits": ({"page_size": "\u0663"},
                     "parameter 'page_size' in config.pbtxt must be an integer, got '\u0663'"),
    "past_int32": ({"max_num_batched_tokens": "2147483648"},
                   "config field 'max_num_batched_tokens' must be an integer >= 1 and <= 2147483647, got 2147483648"),
    "not_finite": ({"accept_threshold": "nan"}, "config field 'accept_threshold' must be a number in [0, 1], got nan"),
    "reaches_no_code": ({"remask_threshold": "0.5"},
                        "config field 'remask_threshold' must be 0.0 for decoding_strategy 'multi_bd' at "
                        "buffer_size 1"),
    "unread_by_the_mode": ({"sampling_mode": "topk", "accept_threshold": "0.5"},
                           "config field 'accept_threshold' must be 0.9 with sampling_mode 'topk' (decoding_strategy "
                           "'multi_bd'): each step accepts the number of positions that 'steps' schedules; got 0.5"),
    "pool_past_memory": ({"num_kv_pages": "2147483647"},
                         "config field 'num_kv_pages' (2147483647): 2147483647 KV pages of "),
}

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "model_repository" / "diffulex"
SERVE_LAUNCHER = Path(__file__).resolve().parents[1] / "tools" / "serve.py"


def serve_launcher():
    """tools/serve.py, the launcher of `make serve` and of the Docker image, as a module: its stop bound's settings."""
    spec = importlib.util.spec_from_file_location("serve", SERVE_LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def data_parallel_group(num_gpus: int) -> tuple[str, set[tuple[str, str]]]:
    """The data-parallel test model's instance_group on this machine, and the (instance name suffix, device) of
    each instance it makes: one per GPU for the first two GPUs, two on one GPU, or two on the CPU. Triton names an
    instance after its group (`<model>_0`) and its place in the group's count, on every GPU alike."""
    if num_gpus >= 2:
        return "[{ kind: KIND_GPU, count: 1, gpus: [0, 1] }]", {("_0_0", "cuda:0"), ("_0_0", "cuda:1")}
    if num_gpus == 1:
        return "[{ kind: KIND_GPU, count: 2, gpus: [0] }]", {("_0_0", "cuda:0"), ("_0_1", "cuda:0")}
    return "[{ kind: KIND_CPU, count: 2 }]", {("_0_0", "cpu"), ("_0_1", "cpu")}


def with_parameters(config_text: str, name: str, **values) -> str:
    """The shipped config.pbtxt under another model name, with some engine parameters replaced."""
    config_text, count = re.subn(r'^name: "diffulex"$', f'name: "{name}"', config_text, flags=re.M)
    assert count == 1, "config.pbtxt has no `name:` line"
    for key, value in values.items():
        pattern = rf'(\{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
        config_text, count = re.subn(pattern, rf'\1"{value}"', config_text)
        assert count == 1, f"config.pbtxt has no parameter {key}"
    return config_text


def with_instance_group(config_text: str, instance_group: str) -> str:
    """The config with another `instance_group` list, e.g. `[{ kind: KIND_CPU, count: 2 }]`."""
    config_text, count = re.subn(r"^instance_group \[.*\]$", f"instance_group {instance_group}", config_text, flags=re.M)
    assert count == 1, "config.pbtxt has no one-line `instance_group`"
    return config_text


def with_backend_parameters(config_text: str, values: dict[str, str]) -> str:
    """The config with parameters the shipped one does not list (the Python backend's own) added to its list."""
    added = "".join(f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }},\n' for key, value in values.items())
    config_text, count = re.subn(r"^parameters \[\n", lambda match: match.group(0) + added, config_text, flags=re.M)
    assert count == 1, "config.pbtxt has no `parameters [` list"
    return config_text


def add_model(repository: Path, name: str, model_file: Path = SHIPPED_MODEL / "1" / "model.py", *,
              instance_group: str | None = None, backend_parameters: dict[str, str] | None = None, **values) -> None:
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(model_file, repository / name / "1" / "model.py")
    config_text = with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), name, **values)
    if instance_group is not None:
        config_text = with_instance_group(config_text, instance_group)
    if backend_parameters:
        config_text = with_backend_parameters(config_text, backend_parameters)
    (repository / name / "config.pbtxt").write_text(config_text)
