"""What the engine hands back: per-step deltas, whole-request results, and the incremental detokenizer."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import FinishReason


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

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class Detokenizer:
    """Turns committed tokens into append-only text. A multi-byte character split across blocks decodes to
    U+FFFD until its last byte arrives, so trailing replacement characters are held back until then. Stop
    strings end the text at their first match, and the tokens at the one that completes it: a block commits
    whole, and the tokens after the match are not output."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out

    def add(self, ids: list[int], final: bool) -> tuple[str, int | None]:
        """Returns the text delta, and when a stop string matched, how many of `ids` are output (None: all)."""
        num_before = len(self.ids)
        self.ids.extend(ids)
        text = self._decode(len(self.ids))
        keep = None
        if self.stop:
            # A match may straddle the previous delta; it cannot start before what was already sent.
            hits = []  # (start, end) of each stop string's first match
            for stop in self.stop:
                start = text.find(stop, max(0, self.sent - len(stop) + 1))
                if start >= 0:
                    hits.append((start, start + len(stop)))
            if hits:
                start, end = min(hits)
                text = text[:start]
                keep = self._tokens_through(end, num_before) - num_before
                del self.ids[num_before + keep:]
        if not (final or keep is not None):
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix_len(text)]
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta, keep

    def _decode(self, num_ids: int) -> str:
        return self.tokenizer.decode(self.ids[:num_ids], skip_special_tokens=True)

    def _tokens_through(self, num_chars: int, low: int) -> int:
        """The fewest tokens (more than `low`) whose text reaches `num_chars` characters. Bisection: a stop is rare
        and a block is at most a few dozen tokens."""
        high = len(self.ids)
        while high - low > 1:
            mid = (low + high) // 2
            if len(self._decode(mid)) >= num_chars:
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
