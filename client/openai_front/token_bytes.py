"""The raw bytes of a token, which OpenAI's log-probabilities carry beside its text.

A token's text, decoded alone, loses the bytes of a character that it holds only part of: byte-level BPE splits "写"
(E5 86 99) into tokens that each decode to U+FFFD. Clients rebuild such characters from the bytes, so the bytes must
be the token's own:
- a byte-level tokenizer (GPT-2's scheme: Llama 3, Qwen, and the test checkpoints) writes each byte as one character
  of a 256-character alphabet, printable Latin-1 bytes as themselves and the others as U+0100 on, in byte order;
- a SentencePiece tokenizer with byte fallback writes a byte it has no piece for as `<0xNN>`;
- any other token's bytes are its decoded text's.
"""

from __future__ import annotations

import json
import re

from tokenizers import pre_tokenizers

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_bytes() -> dict[str, int]:
    """The byte each character of the byte-level alphabet stands for."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    as_themselves = {ord(char) for char in alphabet if ord(char) < 256}
    moved = [byte for byte in range(256) if byte not in as_themselves]  # U+0100 on, in byte order
    return {char: ord(char) if ord(char) < 256 else moved[ord(char) - 256] for char in alphabet}


def decodes_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level, alone or in a sequence of decoders."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its tokens' bytes are their text's
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return any(step.get("type") == "ByteLevel" for step in [decoder, *decoder.get("decoders", [])])


class TokenBytes:
    """token id -> its bytes, for one tokenizer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._alphabet = byte_level_bytes() if decodes_byte_level(tokenizer) else None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._alphabet is not None and all(char in self._alphabet for char in piece):
                return bytes(self._alphabet[char] for char in piece)
            if (fallback := BYTE_FALLBACK.fullmatch(piece)) is not None:
                return bytes([int(fallback.group(1), 16)])
        return self._tokenizer.decode([token_id]).encode("utf-8")
