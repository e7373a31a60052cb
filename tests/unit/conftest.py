"""Shared fixtures of the engine's CPU tests: tiny random-weight checkpoints, one per model family, written once
per test session in each family's real Hugging Face layout (config.json, safetensors, byte-level tokenizer with
an EOS and a mask token)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex_backend.checkpoint import MASK_TOKEN_ID, write_random_checkpoint

FAMILIES = ("llada", "dream", "sdar")

# The weight that maps the last hidden state to the logits, under each family's released name.
OUTPUT_HEAD = {"llada": "model.transformer.ff_out.weight", "dream": "lm_head.weight", "sdar": "lm_head.weight"}


@pytest.fixture(scope="session", autouse=True)
def single_intra_op_thread():
    """The tiny models' matmuls are far too small to share among threads; on a busy CI machine the threads'
    synchronisation makes every forward many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def edit_output_head(path: str | Path, family: str, edit) -> None:
    """Rewrite the checkpoint's output head with `edit(weight)` ([vocab, hidden], edited in place)."""
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    edit(tensors[OUTPUT_HEAD[family]])
    save_file(tensors, file, metadata={"format": "pt"})


def write_trained_like_checkpoint(path: Path, family: str) -> str:
    """A random checkpoint whose head gives the mask token logit 0, far under the top logits (about 20): like a
    trained model, it never predicts the mask token greedily. test_engine_mask_token.py covers one that does."""
    write_random_checkpoint(path, family)
    edit_output_head(path, family, lambda weight: weight[MASK_TOKEN_ID].zero_())
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Checkpoint directory of each family, by model name."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: write_trained_like_checkpoint(root / name, name) for name in FAMILIES}


@pytest.fixture(scope="session")
def llada_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["llada"]


@pytest.fixture(scope="session")
def dream_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["dream"]


@pytest.fixture(scope="session")
def sdar_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["sdar"]
