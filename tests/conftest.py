"""One real tritonserver for the whole session, shared by the server and client suites. It serves the
repository's diffulex model over a tiny random-weight checkpoint.

The model repository is built in a temporary folder from the shipped config.pbtxt and model.py, with
the engine parameters pointed at the checkpoint. `diffulex` (small blocks, so short outputs span several
blocks) is loaded at start. `diffulex_readme` (the shipped settings), `diffulex_llada2` (a tiny MoE model,
picked by model_name), `diffulex_fast_dllm_v2` (Fast-dLLM v2's family and strategy), `diffulex_diffucoder`, `diffulex_dream_reasoner` and
`diffulex_stable_diffcoder` (families picked by model_name, or detected, each with its own default strategy),
`diffulex_unknown_key` (a config.json key no family lists), `diffulex_lora` (LoRA adapters chosen per
request, one of which overflows every forward it takes part in), `diffulex_dmax` (DMax's soft parallel decoding),
`diffulex_tensor_parallel` (one engine over two ranks), `diffulex_data_parallel` (two instances, so two engines,
on two GPUs where there are), `diffulex_bad_path`, `diffulex_bad_*` (a setting of each class the load refuses),
`diffulex_corrupt_*` (weights or an adapter that are not finite), `diffulex_host_inputs` and
`diffulex_device_inputs` (the Python backend's FORCE_CPU_ONLY_INPUT_TENSORS, taken and refused), `diffulex_failing`
(an engine that fails at every step) and `diffulex_dying_*` (a thread of the engine loop that ends;
tests/server/dying_thread_model.py) are loaded by the tests that need them, which is why the
server runs with explicit model control. Stopping the server is checked when the session ends.

Without a GPU the Triton kernels run under Triton's interpreter.
"""

import json
import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must be set before any kernel is defined: triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from families import write_adapter, write_overflowing_adapter  # noqa: E402
from triton_server import (  # noqa: E402
    BAD_SETTINGS, DATA_PARALLEL_SETTINGS, FAST_DLLM_V2_SETTINGS, SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, TEST_SETTINGS,
    TritonServer, TENSOR_PARALLEL_SETTINGS, add_model, data_parallel_group)

from safetensors.torch import load_file, save_file  # noqa: E402

from diffulex_backend import Diffulex  # noqa: E402
from diffulex_backend.testing.checkpoint import write_peft_adapter, write_random_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("checkpoint") / "llada", "llada")


@pytest.fixture(scope="session")
def llada2_checkpoint(tmp_path_factory) -> Path:
    """A tiny LLaDA2 (MoE) checkpoint in the released layout: sharded, one expert at a time."""
    return write_random_checkpoint(tmp_path_factory.mktemp("checkpoint") / "llada2", "llada2", num_shards=2)


@pytest.fixture(scope="session")
def fast_dllm_v2_checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("checkpoint") / "fast_dllm_v2", "fast_dllm_v2")


@pytest.fixture(scope="session")
def coder_and_reasoner_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """DiffuCoder, Dream-reasoner and Stable-DiffCoder, by model name."""
    root = tmp_path_factory.mktemp("checkpoint")
    return {name: write_random_checkpoint(root / name, name)
            for name in ("diffucoder", "dream_reasoner", "stable_diffcoder")}


@pytest.fixture(scope="session")
def unknown_key_checkpoint(tmp_path_factory, checkpoint) -> Path:
    """The session checkpoint with a config.json key that no family lists."""
    directory = Path(shutil.copytree(checkpoint, tmp_path_factory.mktemp("checkpoint") / "unknown_key"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "newly_added_key": 1}))
    return directory


@pytest.fixture(scope="session")
def math_adapter(tmp_path_factory, checkpoint) -> Path:
    """A PEFT LoRA adapter of the session checkpoint, on every attention and MLP projection."""
    return write_adapter(tmp_path_factory.mktemp("adapters") / "math", checkpoint)


@pytest.fixture(scope="session")
def served_lora_modules(tmp_path_factory, checkpoint, math_adapter) -> str:
    """The adapters `diffulex_lora` registers: 'math', and 'huge', which the model loads and whose requests' logits
    overflow to NaN."""
    huge = write_overflowing_adapter(tmp_path_factory.mktemp("adapters") / "huge", checkpoint)
    return f"math={math_adapter},huge={huge}"


# Weights no family can load, each with the words its refusal must hold: model name -> (settings, words).
CORRUPT_WEIGHT = "model.transformer.blocks.0.ff_out.weight"
CORRUPT_ADAPTER_TENSOR = "base_model.model.model.transformer.blocks.1.q_proj.lora_A.weight"


@pytest.fixture(scope="session")
def corrupt_models(tmp_path_factory, checkpoint) -> dict[str, tuple[dict, str]]:
    """Copies of the session checkpoint (or of its adapter) whose values no model could load: NaN and -inf in a
    weight, a finite 1e5 that float16 cannot hold, a weight stored as int8, NaN in a LoRA adapter's tensor, and an
    adapter's finite 1e9 that float16 cannot hold."""
    root = tmp_path_factory.mktemp("corrupt")

    def edited(directory: Path, file: str, edit) -> Path:
        tensors = load_file(directory / file)
        edit(tensors)
        save_file(tensors, directory / file)
        return directory

    def with_value(name: str, value: float) -> Path:
        def edit(tensors):
            tensors[CORRUPT_WEIGHT][3, 5] = value
        return edited(Path(shutil.copytree(checkpoint, root / name)), "model.safetensors", edit)

    def adapter_with_value(name: str, value: float) -> Path:
        def edit(tensors):
            tensors[CORRUPT_ADAPTER_TENSOR][0, 0] = value
        adapter = write_peft_adapter(root / name, checkpoint, ["q_proj"], rank=4, seed=2)
        return edited(adapter, "adapter_model.safetensors", edit)

    def as_int8(tensors):
        tensors[CORRUPT_WEIGHT] = (tensors[CORRUPT_WEIGHT] * 100).to(torch.int8)

    integers = edited(Path(shutil.copytree(checkpoint, root / "int8")), "model.safetensors", as_int8)
    in_file = f"weight {CORRUPT_WEIGHT!r} holds NaN or infinite values: 1 of the"
    return {
        "diffulex_corrupt_nan": ({"model": with_value("nan", float("nan"))}, in_file),
        "diffulex_corrupt_negative_infinity": ({"model": with_value("inf", float("-inf"))}, in_file),
        "diffulex_corrupt_float16_range": ({"model": with_value("range", 1e5), "dtype": "float16"},
                                           f"weight {CORRUPT_WEIGHT!r} is finite in the file but past the range of "
                                           "float16"),
        "diffulex_corrupt_int8": ({"model": integers}, f"weight {CORRUPT_WEIGHT!r} is stored as I8; a weight loads "
                                                       "from F16, BF16, F32, F64"),
        "diffulex_corrupt_adapter": ({"model": checkpoint,
                                      "lora_modules": f"bad={adapter_with_value('nan', float('nan'))}"},
                                     f"adapter 'bad': tensor {CORRUPT_ADAPTER_TENSOR!r} holds NaN or infinite values"),
        "diffulex_corrupt_adapter_float16_range": (
            {"model": checkpoint, "dtype": "float16", "lora_modules": f"wide={adapter_with_value('range', 1e9)}"},
            "adapter 'wide': model.transformer.blocks.1.q_proj's lora_A is past the range of float16"),
    }


@pytest.fixture(scope="session")
def missing_checkpoint(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("empty") / "no-such-checkpoint"


@pytest.fixture(scope="session")
def engine(checkpoint) -> Diffulex:
    """The reference: the same checkpoint and settings in this process."""
    return Diffulex(str(checkpoint), **TEST_SETTINGS)


@pytest.fixture(scope="session")
def server(tmp_path_factory, checkpoint, llada2_checkpoint, fast_dllm_v2_checkpoint, coder_and_reasoner_checkpoints,
           unknown_key_checkpoint, served_lora_modules, missing_checkpoint, corrupt_models):
    repository = tmp_path_factory.mktemp("model_repository")
    add_model(repository, "diffulex", model=checkpoint, **TEST_SETTINGS)
    add_model(repository, "diffulex_readme", model=checkpoint)
    add_model(repository, "diffulex_llada2", model=llada2_checkpoint, model_name="llada2_mini", **TEST_SETTINGS)
    add_model(repository, "diffulex_fast_dllm_v2", model=fast_dllm_v2_checkpoint, **FAST_DLLM_V2_SETTINGS)
    for name, path in coder_and_reasoner_checkpoints.items():
        # decoding_strategy left empty: each engine takes its family's default. Stable-DiffCoder is detected from its
        # config.json; the other two name their family.
        add_model(repository, f"diffulex_{name}", model=path, decoding_strategy="",
                  **({} if name == "stable_diffcoder" else {"model_name": name}), **TEST_SETTINGS)
    add_model(repository, "diffulex_unknown_key", model=unknown_key_checkpoint, **TEST_SETTINGS)
    add_model(repository, "diffulex_lora", model=checkpoint, lora_modules=served_lora_modules, **TEST_SETTINGS)
    add_model(repository, "diffulex_dmax", model=checkpoint, decoding_strategy="dmax", **TEST_SETTINGS)
    add_model(repository, "diffulex_data_parallel", model=checkpoint,
              instance_group=data_parallel_group(torch.cuda.device_count())[0], **DATA_PARALLEL_SETTINGS)
    add_model(repository, "diffulex_tensor_parallel", model=checkpoint, **TENSOR_PARALLEL_SETTINGS)
    add_model(repository, "diffulex_bad_path", model=missing_checkpoint)
    for name, (settings, _) in corrupt_models.items():
        add_model(repository, name, **{**TEST_SETTINGS, **settings})
    # Settings of each class the load refuses by name (tests/server/test_triton_server.py, BAD_SETTINGS).
    for name, (values, _) in BAD_SETTINGS.items():
        add_model(repository, f"diffulex_bad_{name}", model=checkpoint, **values)
    # The Python backend's own parameters beside the engine's: taken, or refused by the model where it cannot run.
    add_model(repository, "diffulex_host_inputs", model=checkpoint, backend_parameters={
        "FORCE_CPU_ONLY_INPUT_TENSORS": "yes"}, **TEST_SETTINGS)
    add_model(repository, "diffulex_device_inputs", model=checkpoint, backend_parameters={
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}, **TEST_SETTINGS)
    add_model(repository, "diffulex_failing", Path(__file__).parent / "server" / "failing_model.py", model=checkpoint,
              **TEST_SETTINGS)
    for name in ("diffulex_dying_at_start", "diffulex_dying_decoder", "diffulex_dying_responder"):
        add_model(repository, name, Path(__file__).parent / "server" / "dying_thread_model.py", model=checkpoint,
                  **TEST_SETTINGS)
    server = TritonServer(repository, repository.parent / "tritonserver.log",
                          ("--model-control-mode=explicit", "--load-model=diffulex",
                           # The server suite loads a model with a bad path on purpose; without this, that
                           # would make the server not ready for the client suite's health checks.
                           "--strict-readiness=false"))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop(SHUTDOWN_TIMEOUT_S)
        raise
    yield server
    # Part of the test: after streaming and cancellations, unloading must not hang and the server exits 0.
    returncode = server.stop(SHUTDOWN_TIMEOUT_S)
    assert returncode == 0, server.log_tail()
    assert "successfully unloaded 'diffulex' version 1" in server.log_tail(20000)
