"""A request resolved once, before it is queued: every check of its parameters (the checks every strategy shares,
always, then its strategy's own), and every value the engine derives from them and the settings, in one frozen
record. A Request is built from that record; nothing merges settings into it or replaces its sampling afterwards.

What the record holds: the prompt's ids; the parameters as sent, with top_k and temperature brought into range;
the sampling record the runner reads (seed, thresholds with the settings' defaults filled in, the adapter's slot,
the edit threshold of a strategy that edits, the log-probabilities asked for, the tokens min_tokens bans); the stop
rule the outputs obey; and the page retention it asks for.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .plan import RequestSampling
from .refusal import Refusal
from .retention import Retention
from .sampling import GREEDY_TEMPERATURE, UNREAD_IN_MODE, SamplingParams

if TYPE_CHECKING:
    from .config import Config

# Sampling parameters that one strategy reads -> that strategy.
STRATEGY_PARAMS = {"sub_block_size": "fast_dllm_v2", "edit_threshold": "dmax"}


@dataclass(frozen=True)
class StopRule:
    """When a request's output ends, besides max_tokens."""

    token_ids: tuple[int, ...]  # stop_token_ids, and the model's EOS ids unless ignore_eos
    strings: tuple[str, ...]
    min_tokens: int  # neither tokens nor strings end the output before this many tokens
    max_tokens: int


@dataclass(frozen=True)
class ResolvedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    sampling: RequestSampling
    stop: StopRule
    retention: Retention | None


def check_params(params: SamplingParams, config: "Config", request_cls) -> None:
    """Refuse the parameters the configured strategy cannot honour: the shared checks, then the strategy's own
    (`request_cls.check_strategy_params`). Raises Refusal naming the parameter."""
    for name, strategy in STRATEGY_PARAMS.items():
        if getattr(params, name) is not None and config.decoding_strategy != strategy:
            raise Refusal(f"sampling parameter '{name}' applies to decoding_strategy '{strategy}' only, "
                          f"not '{config.decoding_strategy}'", name)
    one_block = request_cls.one_block_in_flight(config)
    if params.remask_threshold and one_block is not None:
        raise Refusal(f"sampling parameter 'remask_threshold' must be 0 or null for decoding_strategy "
                      f"'{config.decoding_strategy}'{one_block}, where a request predicts one block a step, got "
                      f"{params.remask_threshold!r}", "remask_threshold")
    if params.retention_ratio not in (None, 1, 1.0) and not request_cls.SUPPORTS_PAGE_RETENTION:
        raise Refusal(f"sampling parameter 'retention_ratio' must be 1 or null for decoding_strategy "
                      f"'{config.decoding_strategy}', which does not drop pages", "retention_ratio")
    request_cls.check_strategy_params(params, config)
    check_mode_params(params, config)
    if params.head_select is not None and effective_retention_ratio(params, config) == 1:
        where = ("the request's, else the engine's setting" if request_cls.SUPPORTS_PAGE_RETENTION else
                 f"which decoding_strategy '{config.decoding_strategy}' keeps at 1: it does not drop pages")
        raise Refusal(f"sampling parameter 'head_select' ranks the pages a request keeps, and applies with a "
                      f"retention_ratio below 1 only ({where}); got {params.head_select!r}", "head_select")


def check_mode_params(params: SamplingParams, config: "Config") -> None:
    """Refuse the parameter that the configured sampling mode never reads (UNREAD_IN_MODE)."""
    unread, reads = UNREAD_IN_MODE[config.mode]
    if getattr(params, unread) is not None:
        raise Refusal(f"sampling parameter '{unread}' does not apply in sampling_mode '{config.sampling_mode}' (of "
                      f"decoding_strategy '{config.decoding_strategy}'): {reads}; got {getattr(params, unread)!r}",
                      unread)


def effective_retention_ratio(params: SamplingParams, config: "Config") -> float:
    """The share of its prompt's pages a request keeps: its own retention_ratio, else the engine's setting."""
    return config.retention_ratio if params.retention_ratio is None else params.retention_ratio


def resolve(prompt_ids: list[int], params: SamplingParams, config: "Config", request_cls, *,
            draw_seed: Callable[[], int], lora_index: int, eos_token_ids: list[int], vocab_size: int) -> ResolvedRequest:
    """The record a Request is built from. `draw_seed` gives the seed of a request that brings none (the engine's
    seed stream), called only once every check passed, so that a refused request leaves the stream where it was;
    `lora_index` is the adapter's slot (-1: none). Raises Refusal for parameters the strategy cannot honour."""
    check_params(params, config, request_cls)
    stop = StopRule(token_ids=tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_token_ids)),
                    strings=tuple(params.stop), min_tokens=params.min_tokens, max_tokens=params.max_tokens)
    # As vLLM does, EOS and stop tokens cannot be sampled at the first min_tokens positions, so the output is at
    # least min_tokens long.
    banned = tuple(sorted(set(stop.token_ids))) if params.min_tokens else ()
    # Nor can the mask token, ever: a ban of every other token would leave those positions nothing to sample.
    if banned and len({t for t in banned if 0 <= t < vocab_size} | {config.mask_token_id}) >= vocab_size:
        raise Refusal(f"sampling parameter 'stop_token_ids' leaves no token to sample under min_tokens "
                      f"({params.min_tokens}): the first min_tokens positions may take no stop or EOS token, and "
                      f"these are every token of the {vocab_size} but the mask token", "stop_token_ids")
    seed = params.seed if params.seed is not None else draw_seed()
    # The step packs both into int64 tensors: the noise hash takes a 32-bit seed (the two halves of a 64-bit one
    # folded together; a seed below 2**32 is unchanged), and a top_k past the vocabulary keeps all of it.
    seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    if params.top_k > vocab_size:
        params = dataclasses.replace(params, top_k=vocab_size)
    if params.temperature < GREEDY_TEMPERATURE:
        params = dataclasses.replace(params, temperature=0.0)
    sampling = RequestSampling(
        seed=seed, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        confidence_kind=params.confidence_kind,
        accept_threshold=config.accept_threshold if params.accept_threshold is None else params.accept_threshold,
        remask_threshold=config.remask_threshold if params.remask_threshold is None else params.remask_threshold,
        lora_index=lora_index,
        edit_threshold=(config.edit_threshold if params.edit_threshold is None else params.edit_threshold)
        if config.decoding_strategy == STRATEGY_PARAMS["edit_threshold"] else 0.0,
        logprobs=-1 if params.logprobs is None else params.logprobs,
        banned_until=len(prompt_ids) + params.min_tokens if banned else 0, banned_ids=banned,
    )
    ratio = effective_retention_ratio(params, config)
    head_select = config.head_select if params.head_select is None else params.head_select
    retention = Retention(ratio, head_select, -(-len(prompt_ids) // config.page_size)) if ratio < 1 else None
    return ResolvedRequest(prompt_ids=prompt_ids, params=params, sampling=sampling, stop=stop, retention=retention)
