"""What the engine hands back: the scheduler's per-step token deltas, the per-step outputs with their text,
whole-request results, and the incremental detokenizer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .request import FinishReason

if TYPE_CHECKING:
    from .runner import TokenLogprobs


@dataclass
class RequestDelta:
    """What one step changed of one request, as the scheduler sees it: the tokens it committed for output, and
    whether they end the request. Plain values; the text is made from them on the engine side."""

    request_id: str
    token_ids: list[int]  # newly committed, cut by the stop token and max_tokens rules
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    nfe: int  # forward passes so far
    # As StepOutput's: only for a request that asks for log-probabilities, aligned with token_ids.
    logprobs: np.ndarray | None = None  # [n] float32
    top_ids: np.ndarray | None = None  # [n, k] int64
    top_logprobs: np.ndarray | None = None  # [n, k] float32
    error: str | None = None  # with finish_reason ERROR: why the request could not be decoded

    def cut(self, keep: int) -> RequestDelta:
        """The delta's first `keep` tokens, ending the request with STOP (a stop string matched in them); the
        tokens left out are not counted as output."""
        return dataclasses.replace(
            self, token_ids=self.token_ids[:keep], finish_reason=FinishReason.STOP,
            num_output_tokens=self.num_output_tokens - (len(self.token_ids) - keep),
            logprobs=None if self.logprobs is None else self.logprobs[:keep],
            top_ids=None if self.top_ids is None else self.top_ids[:keep],
            top_logprobs=None if self.top_logprobs is None else self.top_logprobs[:keep])


@dataclass
class StepOutput:
    """Newly committed output of one request in one step."""

    request_id: str
    token_ids: list[int]  # newly committed
    text: str  # append-only text delta
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    nfe: int  # forward passes so far
    # Only for a request that asks (SamplingParams.logprobs), aligned with token_ids: each token's log-probability
    # and, when it asks for k > 0, the k most likely tokens at its position with theirs (LogprobRecord).
    logprobs: np.ndarray | None = None  # [n] float32
    top_ids: np.ndarray | None = None  # [n, k] int64, most likely first
    top_logprobs: np.ndarray | None = None  # [n, k] float32
    error: str | None = None  # with finish_reason ERROR: why the request could not be decoded

    @classmethod
    def of(cls, delta: RequestDelta, text: str) -> StepOutput:
        """A request's delta with its text."""
        return cls(request_id=delta.request_id, token_ids=delta.token_ids, text=text,
                   finished=delta.finish_reason is not None, finish_reason=delta.finish_reason,
                   num_prompt_tokens=delta.num_prompt_tokens, num_output_tokens=delta.num_output_tokens,
                   nfe=delta.nfe, logprobs=delta.logprobs, top_ids=delta.top_ids, top_logprobs=delta.top_logprobs,
                   error=delta.error)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    nfe: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[float] | None = None  # per token of token_ids, when the request asked for them
    top_logprobs: list[dict[int, float]] | None = None  # per token: the k most likely tokens, most likely first
    error: str | None = None  # with finish_reason ERROR: why the request could not be decoded

    def add(self, delta: StepOutput) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.error = delta.error
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs.tolist()
        if delta.top_ids is not None:
            self.top_logprobs = (self.top_logprobs or []) + [
                dict(zip(ids, lps)) for ids, lps in zip(delta.top_ids.tolist(), delta.top_logprobs.tolist())]

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class LogprobRecord:
    """One request's log-probabilities, per position of its generation area: of the token each position holds, as
    the forward that put it there gave it (for a diffusion model, the step that unmasked it, or that last changed
    it where a strategy edits or remasks tokens), and that forward's top_n most likely tokens."""

    def __init__(self, max_tokens: int, top_n: int):
        self.top_n = top_n
        self.chosen = np.zeros(max_tokens, dtype=np.float32)
        self.top_ids = np.zeros((max_tokens, top_n), dtype=np.int64)
        self.top_logprobs = np.zeros((max_tokens, top_n), dtype=np.float32)

    def update(self, offset: int, before: np.ndarray, after: np.ndarray, mask_token_id: int,
               step: "TokenLogprobs", at: int) -> None:
        """A step turned positions [offset, offset + len(after)) of the generation area from `before` into `after`,
        from rows [at, ...) of the step's log-probabilities: each position whose token changed to another than
        the mask takes its new values."""
        changed = np.flatnonzero((after != before) & (after != mask_token_id))
        if changed.size:
            rows, positions = at + changed, offset + changed
            self.chosen[positions] = step.chosen[rows]
            self.top_ids[positions] = step.top_ids[rows, : self.top_n]
            self.top_logprobs[positions] = step.top_logprobs[rows, : self.top_n]

    def output(self, start: int, end: int) -> dict:
        """StepOutput's log-probability fields for output positions [start, end)."""
        values = {"logprobs": self.chosen[start:end].copy()}
        if self.top_n:
            values.update(top_ids=self.top_ids[start:end].copy(), top_logprobs=self.top_logprobs[start:end].copy())
        return values


class Detokenizer:
    """Turns committed tokens into append-only text. A multi-byte character split across blocks decodes to
    U+FFFD until its last byte arrives, so trailing replacement characters are held back until then. Stop
    strings end the text at their first match, and the tokens at the one that completes it: a block commits
    whole, and the tokens after the match are not output. As in vLLM, a match that ends inside the text of the first
    `min_tokens` tokens does not count.

    Decoding is incremental: each block decodes only the tokens since the last complete character, from the
    last block before them that gave text. A tokenizer may decode a token differently at the start of a text
    (SentencePiece strips the leading space), so the new text is the difference of two decodes that start at the
    same token, one that gives text for both to strip alike. Decoding the whole sequence again at every block
    would cost time in the square of the output length."""

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.floor: int | None = None if min_tokens else 0  # characters of the first min_tokens tokens, once known
        self.confirmed = ""  # the text of ids[:read], which ends with a complete character
        self.prefix = 0  # the decodes of new tokens start here: the last confirmed tokens that gave text
        self.read = 0

    def add(self, ids: list[int], final: bool) -> tuple[str, int | None]:
        """Returns the text delta, and when a stop string matched, how many of `ids` are output (None: all)."""
        num_before = len(self.ids)
        self.ids.extend(ids)
        text = self._text()
        keep = None
        if self.floor is None and len(self.ids) >= self.min_tokens:
            self.floor = len(self._decode(self.min_tokens))
        if self.stop and self.floor is not None:
            # A match may straddle the previous delta; it cannot start before what was already sent, nor end
            # inside the first min_tokens tokens' text.
            hits = []  # (start, end) of each stop string's first match
            for stop in self.stop:
                start = text.find(stop, max(0, self.sent - len(stop) + 1, self.floor - len(stop) + 1))
                if start >= 0:
                    hits.append((start, start + len(stop)))
            if hits:
                start, end = min(hits)
                keep = self._tokens_through(text[:end], num_before) - num_before
                text = text[:start]
                del self.ids[num_before + keep:]
        if not (final or keep is not None):
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix_len(text)]
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta, keep

    def _text(self) -> str:
        """The text of every token so far (equal to decoding them all), decoding only the new ones."""
        head = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        window = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        new = window[len(head):]
        if new.endswith("\ufffd"):  # a character still incomplete: decode from the same place next time
            return self.confirmed + new
        self.confirmed += new
        if new:  # the next decode starts at these tokens; tokens with no text (skipped specials) give no anchor
            self.prefix = self.read
        self.read = len(self.ids)
        return self.confirmed

    def _decode(self, num_ids: int) -> str:
        """The first `num_ids` tokens' text, decoded whole: for the rare questions of where a character falls."""
        return self.tokenizer.decode(self.ids[:num_ids], skip_special_tokens=True)

    def _tokens_through(self, target: str, low: int) -> int:
        """The fewest tokens (more than `low`) whose text begins with `target`, its last character whole (a
        partial one decodes to U+FFFD, which would count as a character). Bisection: a stop is rare and a block is
        at most a few dozen tokens."""
        high = len(self.ids)
        while high - low > 1:
            mid = (low + high) // 2
            if self._decode(mid).startswith(target):
                high = mid
            else:
                low = mid
        return high

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop string: it may yet become a match."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
