"""Strict reading of a Hugging Face config.json: every key is known, every required key is there.

A family lists the keys its released config.json has. A key outside that list (plus the few that every HF
config carries) is an error, because a setting we do not read is a setting we would silently get wrong.
Every error names the file and the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

# Keys any HF config may carry that say nothing about the architecture.
HF_COMMON_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "model_type", "torch_dtype", "dtype",
    "transformers_version", "use_cache",
})

_MISSING = object()


class ConfigReader:
    def __init__(self, config: dict, path: str | Path, family: str, known_keys: Iterable[str]):
        if not isinstance(config, dict):
            raise ValueError(f"{path}: the top level must be a JSON object, got {type(config).__name__}")
        self.config = config
        self.path = path
        unknown = sorted(set(config) - set(known_keys) - HF_COMMON_KEYS)
        if unknown:
            raise ValueError(
                f"{path}: unknown config key {unknown[0]!r} for model {family!r}"
                + (f" (and {len(unknown) - 1} more: {unknown[1:]})" if len(unknown) > 1 else "")
            )

    def _get(self, key: str, default: Any) -> Any:
        value = self.config.get(key, default)
        if value is _MISSING:
            raise ValueError(f"{self.path}: missing required config key {key!r}")
        return value

    def int(self, key: str, default: Any = _MISSING, *, allow_none: bool = False) -> int | None:
        value = self._get(key, default)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{self.path}: config key {key!r} must be a positive integer, got {value!r}")
        return value

    def token_id(self, key: str) -> int | None:
        value = self.config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{self.path}: config key {key!r} must be a token id or null, got {value!r}")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An id, a list of ids, or null (eos_token_id takes all three forms)."""
        value = self.config.get(key)
        ids = [] if value is None else value if isinstance(value, list) else [value]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"{self.path}: config key {key!r} must be a token id, a list of them, or null, got {value!r}")
        return tuple(ids)

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{self.path}: config key {key!r} must be a positive number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.path}: config key {key!r} must be true or false, got {value!r}")
        return value

    def expect(self, key: str, supported: tuple, default: Any = _MISSING) -> Any:
        """A key whose other values select an architecture this engine does not implement."""
        value = self._get(key, default)
        if value not in supported:
            allowed = " or ".join(repr(v) for v in supported)
            raise ValueError(f"{self.path}: config key {key!r} is {value!r}; only {allowed} is supported")
        return value
