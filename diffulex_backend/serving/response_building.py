"""Turn a request's engine outputs into the output arrays of its Triton responses.

`ResponseAssembler` follows one request. Streaming, every engine output becomes one response holding the
text and token ids committed since the last one. Not streaming, outputs are gathered and a single response
is made when the request finishes (the generate endpoint needs exactly one). The last response also
carries the `return_*` outputs that the client asked for. `output_ids` holds generated tokens only.

A request that asks for log-probabilities (`return_log_probs`, or the sampling parameter `logprobs`) gets them in
every response, aligned with `output_ids`: `log_probs` and, in TensorRT-LLM's shapes, `output_log_probs` (one
beam) and `cum_log_probs` (their sum over all tokens so far); with `logprobs` k > 0 also `top_log_probs` and
`top_log_prob_ids`, the k most likely tokens at each position, most likely first. Where fewer than k tokens could be
sampled (the others banned, by `min_tokens` or the mask), the rest come with a log-probability of minus infinity,
sent as LOGPROB_FLOOR, as OpenAI and vLLM send it: JSON has no infinity, and the generate endpoint writes JSON. NaN
and +inf are never sent: the engine ends a request whose logits hold them with an error before it responds.

Arrays carry the batch dimension of a batched model: a string output has shape [1, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .request_parsing import ParsedRequest

LOGPROB_FLOOR = -9999.0

if TYPE_CHECKING:
    from .. import StepOutput


@dataclass
class ResponseAssembler:
    request: ParsedRequest
    # The prompt as text, prepended to a non-streamed `text_output` unless `exclude_input_in_output`. A call,
    # so that token-id prompts are decoded only when needed, and only once the engine has accepted them.
    prompt_text: Callable[[], str]
    _text: list[str] = field(default_factory=list)  # gathered deltas of a non-streamed request
    _token_ids: list[int] = field(default_factory=list)
    _logprobs: list[np.ndarray] = field(default_factory=list)  # gathered per output, like the text
    _top_ids: list[np.ndarray] = field(default_factory=list)
    _top_logprobs: list[np.ndarray] = field(default_factory=list)
    _cum_log_prob: float = 0.0  # of the tokens already sent

    def add(self, output: StepOutput) -> dict[str, np.ndarray] | None:
        """The arrays of the response to send for this engine output, or None when nothing is due yet."""
        if self.request.stream:
            return self._arrays(output.text, output.token_ids, output, output.logprobs, output.top_ids,
                                output.top_logprobs)
        self._text.append(output.text)
        self._token_ids.extend(output.token_ids)
        for gathered, part in ((self._logprobs, output.logprobs), (self._top_ids, output.top_ids),
                               (self._top_logprobs, output.top_logprobs)):
            if part is not None:
                gathered.append(part)
        if not output.finished:
            return None
        text = "".join(self._text)
        if not self.request.exclude_input_in_output:
            text = self.prompt_text() + text
        joined = [np.concatenate(parts) if parts else None
                  for parts in (self._logprobs, self._top_ids, self._top_logprobs)]
        return self._arrays(text, self._token_ids, output, *joined)

    def _arrays(self, text: str, token_ids: list[int], output: StepOutput, logprobs: np.ndarray | None,
                top_ids: np.ndarray | None, top_logprobs: np.ndarray | None) -> dict[str, np.ndarray]:
        arrays = {
            "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
            "output_ids": np.array([token_ids], dtype=np.int32).reshape(1, len(token_ids)),
        }
        if logprobs is not None:
            logprobs = sendable_logprobs(logprobs).reshape(1, -1)  # [1, tokens]
            self._cum_log_prob += float(logprobs.sum(dtype=np.float64))
            arrays["log_probs"] = logprobs
            arrays["output_log_probs"] = logprobs.reshape(1, 1, -1)  # [batch, beam, tokens]
            arrays["cum_log_probs"] = np.array([[self._cum_log_prob]], dtype=np.float32)  # [batch, beam]
        if top_ids is not None:
            arrays["top_log_probs"] = sendable_logprobs(top_logprobs)[None]  # [1, tokens, k]
            arrays["top_log_prob_ids"] = top_ids.astype(np.int32)[None]
        if not output.finished:
            return arrays
        if self.request.return_finish_reason:
            reason = output.finish_reason.value if output.finish_reason is not None else ""
            arrays["finish_reason"] = np.array([[reason.encode("utf-8")]], dtype=np.object_)
        if self.request.return_num_input_tokens:
            arrays["num_input_tokens"] = np.array([[output.num_prompt_tokens]], dtype=np.uint32)
        if self.request.return_num_output_tokens:
            arrays["num_output_tokens"] = np.array([[output.num_output_tokens]], dtype=np.uint32)
        if self.request.return_nfe:
            arrays["nfe"] = np.array([[output.nfe]], dtype=np.uint32)
        return arrays


def sendable_logprobs(values: np.ndarray) -> np.ndarray:
    """Log-probabilities as float32 a response may carry: -inf (a token that could not be sampled) as LOGPROB_FLOOR.
    Raises ValueError on NaN or +inf, which no log-probability of a request still decoding can be: the response is
    then not built, and the request ends with an error rather than a body JSON cannot hold."""
    floored = np.maximum(values.astype(np.float32), LOGPROB_FLOOR)  # keeps NaN and +inf
    if not np.isfinite(floored).all():
        raise ValueError(f"log-probabilities hold NaN or +inf: {np.count_nonzero(~np.isfinite(floored))} of "
                         f"{floored.size}")
    return floored
