"""A real tritonserver serving the repository's diffulex model over a tiny random-weight checkpoint.

The model repository is built in a temporary folder from the shipped config.pbtxt and model.py, with
the engine parameters pointed at the checkpoint. `diffulex` (small blocks, so short outputs span several
blocks) is loaded at start. `diffulex_readme` (the shipped settings), `diffulex_bad_path` and
`diffulex_failing` (an engine that fails at every step) are loaded by the tests that need them, which is
why the server runs with explicit model control. Stopping the server is checked when the session ends.
"""

import re
import shutil
from pathlib import Path

import pytest
from triton_server import TEST_SETTINGS, TritonServer

from diffulex_backend import Diffulex
from diffulex_backend.checkpoint import write_random_checkpoint

SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "diffulex"

STARTUP_TIMEOUT_S = 300  # the Python backend imports torch twice (config auto-complete, then the model)
SHUTDOWN_TIMEOUT_S = 90


def with_parameters(config_text: str, name: str, **values) -> str:
    """The shipped config.pbtxt under another model name, with some engine parameters replaced."""
    config_text, count = re.subn(r'^name: "diffulex"$', f'name: "{name}"', config_text, flags=re.M)
    assert count == 1, "config.pbtxt has no `name:` line"
    for key, value in values.items():
        pattern = rf'(\{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
        config_text, count = re.subn(pattern, rf'\1"{value}"', config_text)
        assert count == 1, f"config.pbtxt has no parameter {key}"
    return config_text


def add_model(repository: Path, name: str, model_file: Path = SHIPPED_MODEL / "1" / "model.py", **values) -> None:
    (repository / name / "1").mkdir(parents=True)
    shutil.copy(model_file, repository / name / "1" / "model.py")
    config_text = (SHIPPED_MODEL / "config.pbtxt").read_text()
    (repository / name / "config.pbtxt").write_text(with_parameters(config_text, name, **values))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("checkpoint") / "llada", "llada")


@pytest.fixture(scope="session")
def missing_checkpoint(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("empty") / "no-such-checkpoint"


@pytest.fixture(scope="session")
def engine(checkpoint) -> Diffulex:
    """The reference: the same checkpoint and settings in this process."""
    return Diffulex(str(checkpoint), **TEST_SETTINGS)


@pytest.fixture(scope="session")
def server(tmp_path_factory, checkpoint, missing_checkpoint):
    repository = tmp_path_factory.mktemp("model_repository")
    add_model(repository, "diffulex", model=checkpoint, **TEST_SETTINGS)
    add_model(repository, "diffulex_readme", model=checkpoint)
    add_model(repository, "diffulex_bad_path", model=missing_checkpoint)
    add_model(repository, "diffulex_failing", Path(__file__).parent / "failing_model.py", model=checkpoint,
              **TEST_SETTINGS)
    server = TritonServer(repository, repository.parent / "tritonserver.log",
                          ("--model-control-mode=explicit", "--load-model=diffulex"))
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
