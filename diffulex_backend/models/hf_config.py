"""Reading a Hugging Face config.json: every required key is there, and every key that selects math this engine
does not build is refused.

A family lists the keys it accepts: those it reads or checks, and those its released config.json carries that
change no forward pass (training and bookkeeping settings). A key on neither list is not an error, because one
new bookkeeping key would otherwise fail the load of a real checkpoint: the reader collects it in `unrecognized`,
the family keeps it on its `ModelArch`, and the loader warns naming it. A key whose value selects math that is not
built (`rope_scaling` of any kind, `hidden_act` other than SiLU, ...) is refused by `expect`, naming it.
Every error names the file and the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

# Keys any HF config may carry that change no forward pass: where the file came from, which classes remote code
# would use, the dtype the weights were saved in (the engine picks its own), generation's KV-cache switch, what a
# transformers model returns, labels of a classification head, and transformers' generate() defaults (a request's
# sampling parameters decide decoding here). Older transformers write all of PretrainedConfig's attributes.
INERT_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "model_type", "torch_dtype", "dtype",
    "transformers_version", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "_attn_implementation_autoset",
    "finetuning_task", "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})
# The only RoPE transformers calls "default": no scaling of the frequencies.
UNSCALED_ROPE = "default"

_MISSING = object()


class ConfigReader:
    def __init__(self, config: dict, path: str | Path, family: str, known_keys: Iterable[str]):
        if not isinstance(config, dict):
            raise ValueError(f"{path}: the top level must be a JSON object, got {type(config).__name__}")
        self.config = config
        self.path = path
        # Keys the family neither reads nor knows to be inert, in sorted order.
        self.unrecognized = tuple(sorted(set(config) - set(known_keys) - INERT_KEYS))

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

    def rope_theta(self, default: Any = _MISSING) -> float:
        """RoPE's base. Transformers 4 writes it as `rope_theta` beside `rope_scaling`; transformers 5 as
        `rope_parameters` {"rope_type", "rope_theta"}. Only unscaled RoPE is built: a scaling of any other type
        (linear, dynamic, yarn, llama3, ...) is refused naming the key."""
        scaling = self.config.get("rope_scaling")
        if scaling is not None and _rope_type(scaling) != UNSCALED_ROPE:
            raise ValueError(f"{self.path}: config key 'rope_scaling' is {scaling!r}; only null (no RoPE scaling) is"
                             " supported")
        parameters = self.config.get("rope_parameters")
        if parameters is None:
            return self.float("rope_theta", default)
        if not isinstance(parameters, dict) or _rope_type(parameters) != UNSCALED_ROPE:
            raise ValueError(f"{self.path}: config key 'rope_parameters' is {parameters!r}; only rope_type"
                             f" {UNSCALED_ROPE!r} (no RoPE scaling) is supported")
        theta = parameters.get("rope_theta", self.config.get("rope_theta", default))
        if theta is _MISSING:
            raise ValueError(f"{self.path}: missing required config key 'rope_theta' (in 'rope_parameters')")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ValueError(f"{self.path}: config key 'rope_parameters' must hold a positive 'rope_theta', got {theta!r}")
        return float(theta)


def _rope_type(rope: Any) -> Any:
    """The RoPE type a `rope_scaling` or `rope_parameters` value names ("type" in older files)."""
    if not isinstance(rope, dict):
        return rope
    return rope.get("rope_type", rope.get("type", UNSCALED_ROPE))
