"""Edits of tiny random checkpoints that the engine tests need, made in the files, as a released checkpoint
would carry them."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

# The weight that maps the last hidden state to the logits, under each family's released name.
OUTPUT_HEAD = {"llada": "model.transformer.ff_out.weight", "dream": "lm_head.weight", "sdar": "lm_head.weight"}


def edit_output_head(path: str | Path, family: str, edit) -> None:
    """Rewrite the checkpoint's output head with `edit(weight)` ([vocab, hidden], edited in place)."""
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    edit(tensors[OUTPUT_HEAD[family]])
    save_file(tensors, file, metadata={"format": "pt"})
