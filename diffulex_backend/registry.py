"""Registries: the strategy table, keyed by decoding strategy, and the model families, keyed by model name.

Importing a strategy or model module fills them; the engine only ever looks things up. This module imports
nothing of the engine but the sampling mode a strategy defaults to, so config.py can check a strategy name
without importing the strategies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from .sampling import SamplingMode

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
            for name in (key, *aliases):
                if name in self._entries or name in self._aliases:
                    raise ValueError(f"{self.kind}: {self.key_name} {name!r} is registered twice")
            self._entries[key] = obj
            for alias in aliases:
                self._aliases[alias] = key
            if default:
                self._default = key
            return obj

        return decorator

    def canonical(self, key: str | None) -> str:
        """The registered key that `key` (or an alias of it, or None for the default) names."""
        return self._canonical(key, self.kind)

    def _canonical(self, key: str | None, kind: str) -> str:
        if key is None:
            if self._default is None:
                raise ValueError(f"{kind}: no default {self.key_name}; registered: {self.keys()}")
            return self._default
        key = self._aliases.get(key, key)
        if key not in self._entries:
            raise ValueError(f"{kind}: unknown {self.key_name} {key!r}; registered: {self.keys()}")
        return key

    def get(self, key: str | None) -> T:
        return self._entries[self.canonical(key)]

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def values(self) -> list[T]:
        return [self._entries[key] for key in self.keys()]

    def __contains__(self, key: str) -> bool:
        return self._aliases.get(key, key) in self._entries


def no_checks(config) -> None:
    """A strategy that accepts every valid config."""


@dataclass(frozen=True)
class Strategy:
    """Everything a decoding strategy is made of, registered once under its name."""

    name: str
    request_cls: type
    scheduler_cls: type
    kv_cache_cls: type
    runner_cls: type
    acceptance_cls: type
    default_sampling_mode: SamplingMode  # when the config leaves sampling_mode unset
    supports_prefix_caching: bool  # the prompt's K/V depend on the prompt only: its pages can be shared
    # The strategy's own checks of the Config being built (config.py calls it); raises ValueError.
    validate: Callable[..., None] = no_checks
    aliases: tuple[str, ...] = ()
    # The Config fields only some strategies read, that this one reads. Under any other strategy such a field must
    # keep its default: a value that would change nothing is refused by name (Config.__post_init__).
    options: frozenset[str] = frozenset()


STRATEGIES: Registry[Strategy] = Registry("strategies", "decoding_strategy")


def register_strategy(strategy: Strategy, default: bool = False) -> Strategy:
    return STRATEGIES.register(strategy.name, aliases=strategy.aliases, default=default)(strategy)


# Keyed by model name ("llada", "dream", "sdar").
AutoModelForDiffusionLM: Registry = Registry("AutoModelForDiffusionLM", "model_name")


# The strategy of a family that names no other (its DEFAULT_STRATEGY), and of settings that name no family.
DEFAULT_STRATEGY = "multi_bd"


def default_strategy(model_name: str | None) -> str:
    """The decoding strategy that settings naming none get: the family's own when `model_name` names a registered
    family (DiffuCoder's is d2f), else DEFAULT_STRATEGY. A family detected from config.json later does not change
    it: the families that config.json cannot name are exactly the ones a setting must name."""
    if model_name is None or model_name not in AutoModelForDiffusionLM:
        return DEFAULT_STRATEGY
    return AutoModelForDiffusionLM.get(model_name).DEFAULT_STRATEGY
