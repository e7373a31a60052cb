"""Shared fixtures of the engine's CPU tests: tiny random-weight checkpoints, one per model family, written once
per test session in each family's real Hugging Face layout (config.json, safetensors, byte-level tokenizer with
an EOS and a mask token)."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend.testing.checkpoint import write_random_checkpoint

FAMILIES = ("llada", "dream", "sdar")


@pytest.fixture(scope="session", autouse=True)
def single_intra_op_thread():
    """The tiny models' matmuls are far too small to share among threads; on a busy CI machine the threads'
    synchronisation makes every forward many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Checkpoint directory of each family, by model name."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: str(write_random_checkpoint(root / name, name)) for name in FAMILIES}


@pytest.fixture(scope="session")
def llada_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["llada"]
