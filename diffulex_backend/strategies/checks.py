"""Config checks that several strategies share; each strategy's `validate` composes the ones that apply to it."""
from __future__ import annotations

from ..config import Config


def refuse_prefix_caching(config: Config) -> None:
    # A bidirectional prompt (d2f) or full attention makes a prompt page's K/V depend on tokens after it, so a
    # cached page could not be reused.
    if config.enable_prefix_caching:
        raise ValueError(f"config field 'enable_prefix_caching' must be false for decoding_strategy "
                         f"'{config.decoding_strategy}': its prompt K/V depend on later tokens")


def check_buffer_size(config: Config, most: int) -> None:
    if config.buffer_size > most:
        raise ValueError(f"config field 'buffer_size' must be <= {most} for decoding_strategy "
                         f"'{config.decoding_strategy}', got {config.buffer_size}")


def check_batched_tokens(config: Config, need: int | None, what: str) -> None:
    """`need` tokens (`what` they are) must fit one forward; None: not known until the checkpoint is read."""
    if need is not None and config.max_num_batched_tokens < need:
        raise ValueError(f"config field 'max_num_batched_tokens' must be >= {need} for decoding_strategy "
                         f"'{config.decoding_strategy}' ({what}), got {config.max_num_batched_tokens}")


def check_whole_sequence_fits(config: Config) -> None:
    """Strategies that feed a request's whole sequence in one forward."""
    check_batched_tokens(config, config.max_model_len, "tokens of one request's largest forward")
