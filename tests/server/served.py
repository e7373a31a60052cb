"""Talking to the test server: HTTP generate and SSE, metrics, and gRPC streams, as a client would."""

import base64
import json
import os
import queue
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from diffulex_backend import Diffulex, SamplingParams


# ---- HTTP helpers -----------------------------------------------------------------------------------------
def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def generate(server, body: dict, model: str = "diffulex") -> dict:
    status, payload = post(f"{server.http_url}/v2/models/{model}/generate", body)
    assert status == 200, payload
    return json.loads(payload)


def load_shipped(server, name: str, instance_group: str | None = None, **values) -> None:
    """Load the shipped config.pbtxt and model.py under another name, through the load API's file override, with
    some engine parameters (and the instance_group) replaced; `model` defaults to the shipped demo checkpoint."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2
    from triton_server import SHIPPED_MODEL, with_instance_group, with_parameters

    config_text = with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), name,
                                  **{"model": SHIPPED_MODEL / "demo-llada", **values})
    if instance_group is not None:
        config_text = with_instance_group(config_text, instance_group)
    config = json_format.MessageToJson(text_format.Parse(config_text, model_config_pb2.ModelConfig()))
    model_file = base64.b64encode((SHIPPED_MODEL / "1" / "model.py").read_bytes()).decode()
    status, payload = post(f"{server.http_url}/v2/repository/models/{name}/load",
                           {"parameters": {"config": config, "file:1/model.py": model_file}})
    assert status == 200, payload


def generate_stream(server, body: dict) -> list[dict]:
    status, payload = post(f"{server.http_url}/v2/models/diffulex/generate_stream", body)
    assert status == 200, payload
    return [json.loads(line[len("data: "):]) for line in payload.decode().splitlines() if line.startswith("data: ")]


def ids(value) -> list[int]:  # the generate extension writes a one-element tensor as a scalar
    return value if isinstance(value, list) else [value]


def metrics(server, model: str = "diffulex") -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {}
    for name, labels, value in re.findall(r"^(\w+)\{([^}]*)\} (\S+)$", text, flags=re.M):
        if f'model="{model}"' in labels and "le=" not in labels:
            values[name] = float(value)
    return values


def wait_for(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def reference(engine: Diffulex, prompts, **params):
    return engine.generate(prompts, SamplingParams(**params))


# ---- gRPC helpers -----------------------------------------------------------------------------------------
def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    item = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    item.set_data_from_numpy(array)
    return item


def grpc_inputs(prompt, params: dict, **flags) -> list[grpcclient.InferInput]:
    if isinstance(prompt, str):
        inputs = [tensor("text_input", np.array([[prompt.encode()]], dtype=np.object_))]
    else:
        inputs = [tensor("input_ids", np.array([prompt], dtype=np.int64))]
    inputs.append(tensor("sampling_parameters", np.array([[json.dumps(params).encode()]], dtype=np.object_)))
    inputs += [tensor(name, np.array([[value]], dtype=np.bool_)) for name, value in flags.items()]
    return inputs


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def grpc_stream(server, inputs, model: str = "diffulex") -> list:
    """Every response of one request sent over a gRPC stream, up to the final one."""
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, inputs)
        results = []
        while not results or not is_final(results[-1]):
            result, error = responses.get(timeout=120)
            if error is not None:
                raise error
            results.append(result)
        client.stop_stream()
    return results


def decoded(result, name: str) -> str:
    return result.as_numpy(name).reshape(-1)[0].decode()


def stub_pids(server, model: str) -> list[int]:
    """The Python backend stubs of this server (its children) that serve `model`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == server.process.pid and len(cmdline) > 1 and cmdline[1].endswith(
                    f"/{model}/1/model.py".encode()):
                pids.append(int(entry.name))
    return pids


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
