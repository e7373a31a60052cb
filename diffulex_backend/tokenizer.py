"""The checkpoint's tokenizer, and the mask and EOS ids the engine decodes with."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from diffulex_backend.loader import CheckpointError
from diffulex_backend.arch import ModelArch

# Any one of these makes a directory hold a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer in the checkpoint directory, from local files only and without remote code.

    A tokenizer_config.json that names a custom class (Dream's DreamTokenizer lives in remote code) falls
    back to the plain fast tokenizer of tokenizer.json, which holds the same vocabulary.
    """
    directory = Path(path)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{directory}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        # An empty config keeps AutoTokenizer from reading config.json, whose model_type it does not know;
        # tokenizer_config.json's tokenizer_class picks the class.
        return AutoTokenizer.from_pretrained(
            directory, config=PretrainedConfig(), trust_remote_code=False, local_files_only=True
        )
    except (ValueError, OSError) as e:
        if not (directory / "tokenizer.json").is_file():
            raise CheckpointError(f"{directory}: cannot load the tokenizer: {e}") from e
        try:
            return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
        except Exception as fallback_error:  # transformers raises many types for a bad file
            raise CheckpointError(f"{directory / 'tokenizer.json'}: cannot load the tokenizer: {fallback_error}") from e


def resolve_mask_token_id(arch: ModelArch, tokenizer: PreTrainedTokenizerBase) -> int:
    """config.json's mask_token_id, else the tokenizer's mask token."""
    if arch.mask_token_id is not None:
        return arch.mask_token_id
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    raise ValueError(
        f"model {arch.model_name!r}: no mask token: config.json has no 'mask_token_id' and the tokenizer"
        " defines no mask_token; set mask_token_id"
    )


def resolve_eos_token_ids(arch: ModelArch, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """config.json's eos_token_id(s) and the tokenizer's EOS, deduplicated in that order. Instruct models
    often end a turn with a token (the tokenizer's EOS) that differs from the config's end of text."""
    ids = list(arch.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters of text one token can stand for: its vocabulary string's length, which is at least
    what it decodes to (byte-level and SentencePiece markers replace a character one for one)."""
    return max(1, max(map(len, tokenizer.get_vocab())))
