"""Registries that map a decoding strategy or a model name to the class that implements it.

Importing a strategy or model module fills them, by decorator; the engine only ever looks things up.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, key_name: str):
        self.kind = kind
        self.key_name = key_name
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._default: str | None = None

    def register(self, key: str, *, aliases: tuple[str, ...] = (), default: bool = False) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if key in self._entries or key in self._aliases:
                raise ValueError(f"{self.kind}: {self.key_name} {key!r} is registered twice")
            self._entries[key] = obj
            for alias in aliases:
                self._aliases[alias] = key
            if default:
                self._default = key
            return obj

        return decorator

    def canonical(self, key: str | None) -> str:
        """The registered key that `key` (or an alias of it, or None for the default) names."""
        if key is None:
            if self._default is None:
                raise ValueError(f"{self.kind}: no default {self.key_name}; registered: {self.keys()}")
            return self._default
        key = self._aliases.get(key, key)
        if key not in self._entries:
            raise ValueError(f"{self.kind}: unknown {self.key_name} {key!r}; registered: {self.keys()}")
        return key

    def get(self, key: str | None) -> T:
        return self._entries[self.canonical(key)]

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, key: str) -> bool:
        return self._aliases.get(key, key) in self._entries


# Keyed by decoding strategy. A strategy module registers one entry in each.
AutoReq: Registry = Registry("AutoReq", "decoding_strategy")
AutoScheduler: Registry = Registry("AutoScheduler", "decoding_strategy")
AutoKVCacheManager: Registry = Registry("AutoKVCacheManager", "decoding_strategy")
AutoModelRunner: Registry = Registry("AutoModelRunner", "decoding_strategy")
AutoSampler: Registry = Registry("AutoSampler", "decoding_strategy")

# Keyed by model name ("llada", "dream", "sdar").
AutoModelForDiffusionLM: Registry = Registry("AutoModelForDiffusionLM", "model_name")
