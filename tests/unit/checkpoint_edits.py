"""Edits of tiny random checkpoints that the engine tests need, made in the files, as a released checkpoint
would carry them."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from diffulex_backend.checkpoint import MASK_TOKEN_ID, write_random_checkpoint

# The weight that maps the last hidden state to the logits, under each family's released name.
OUTPUT_HEAD = {"llada": "model.transformer.ff_out.weight", "dream": "lm_head.weight", "sdar": "lm_head.weight"}


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
