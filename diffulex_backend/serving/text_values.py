"""Values that arrive as text where a dataclass field wants a number or a boolean: config.pbtxt's parameters
(always strings) and sampling parameters that clients send as strings (genai-perf's `{"max_tokens": "16"}`)."""

from __future__ import annotations

import re
import types
import typing

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
INTEGER = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
NAMED = ("inf", "infinity", "nan")


def field_types(cls) -> dict[str, object]:
    """Each field's annotation, with `X | None` taken as X; `optional_fields` says which were optional."""
    return {name: _base_type(annotation) for name, annotation in typing.get_type_hints(cls).items()}


def optional_fields(cls) -> set[str]:
    return {name for name, annotation in typing.get_type_hints(cls).items()
            if type(None) in typing.get_args(annotation)}


def from_text(text: str, base) -> object:
    """`text` as a `base` (bool, int or float; any other type takes the text as it is). Raises ValueError."""
    text = text.strip()
    if base is bool:
        word = text.lower()
        if word not in TRUE_WORDS + FALSE_WORDS:
            raise ValueError(f"not true or false: {text!r}")
        return word in TRUE_WORDS
    # Python's int() and float() also take digit separators ("1_000") and other scripts' digits ("٣"): a typo or
    # a lookalike would pass as a number.
    if base is int and INTEGER.fullmatch(text):
        return int(text)
    if base is float and (DECIMAL.fullmatch(text) or text.lower().lstrip("+-") in NAMED):
        return float(text)  # inf and nan are numbers here; the setting then refuses them by name
    if base in (int, float):
        raise ValueError(f"not {'an integer' if base is int else 'a number'}: {text!r}")
    return text


def _base_type(annotation):
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
