"""OpenAI response bodies built from the model's responses: whole completions, streamed chunks and usage.

The model's final response of each choice carries its finish reason and token counts. Usage counts each prompt's
tokens once, however many choices it has, and adds up the tokens of every choice.

Log-probabilities come with the model's responses, aligned with their tokens, when the request asked for them. A
token is named by its text as the tokenizer decodes it alone, or `token_id:N` (as vLLM's
--return-tokens-as-token-ids writes it) when the front runs without --tokenizer. Its `bytes` are the token's own
(token_bytes.py), and a completion's `text_offset` counts the characters its choice's bytes make before it, so that a
token inside a character shares that character's offset; a special token (EOS), which the text leaves out, adds
none. Without --tokenizer a name's bytes stand for the token's.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from http import HTTPStatus

from .errors import OpenAIError
from .generation import ChoiceResponse
from .schemas import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs,
    Completion, CompletionChoice, CompletionLogprobs, TokenLogprob, TopLogprob, Usage)
from .token_bytes import TokenBytes

FINISH_REASONS = ("stop", "length")


def finish_reason_of(arrival: ChoiceResponse) -> str | None:
    reason = arrival.response.finish_reason
    if reason is not None and reason not in FINISH_REASONS:
        raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"the model ended choice {arrival.request.index} with "
                          f"finish reason '{reason}'", code="model_not_ready")
    return reason


class TokenNames:
    """The text of a token id in log-probabilities, and its bytes (`bytes_of`)."""

    def __init__(self, tokenizer=None):
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}
        self._bytes = None if tokenizer is None else TokenBytes(tokenizer)
        # The model's text leaves these out: it decodes with skip_special_tokens, which drops the named special
        # tokens and every added token marked special.
        self._special = frozenset() if tokenizer is None else frozenset(tokenizer.all_special_ids) | {
            token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}

    def bytes_of(self, token_id: int) -> bytes:
        return self(token_id).encode("utf-8") if self._bytes is None else self._bytes(token_id)

    def text_bytes_of(self, token_id: int) -> bytes:
        """The bytes the token adds to the choice's text: none for a special token, which the text leaves out."""
        return b"" if token_id in self._special else self.bytes_of(token_id)

    def row(self, alternatives) -> dict[str, float]:
        """A completion's top-logprobs row, name -> log-probability. Tokens whose texts are the same (byte tokens
        that each decode to U+FFFD) share one name, which keeps the most likely one's: such a row holds fewer
        names than it has alternatives."""
        named: dict[str, float] = {}
        for token_id, logprob in alternatives:
            name = self(token_id)
            if name not in named or logprob > named[name]:
                named[name] = logprob
        return named

    def __call__(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self._tokenizer.decode([token_id])
        return name


@dataclass
class TokenRun:
    """Tokens of one choice with their log-probabilities, as one or more model responses carried them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] | None = None

    @classmethod
    def of(cls, arrival: ChoiceResponse) -> TokenRun | None:
        response = arrival.response
        if response.logprobs is None:
            return None
        top = None if response.top_logprobs is None else list(response.top_logprobs)
        return cls(list(response.token_ids), list(response.logprobs), top)

    def extend(self, other: TokenRun) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        if other.top is not None:
            self.top = (self.top or []) + other.top


@dataclass
class LogprobsFormat:
    """OpenAI's log-probability objects; a completion's text offsets run on across the chunks of a choice."""

    names: TokenNames
    # choice index -> (characters its tokens' bytes made so far, the UTF-8 decoder that holds a character's
    # first bytes until its last comes)
    texts: dict[int, tuple[int, codecs.IncrementalDecoder]] = field(default_factory=dict)

    def completion(self, index: int, run: TokenRun | None) -> CompletionLogprobs | None:
        if run is None:
            return None
        characters, decoder = self.texts.get(index) or (0, codecs.getincrementaldecoder("utf-8")("replace"))
        offsets = []
        for token_id in run.token_ids:
            offsets.append(characters)
            characters += len(decoder.decode(self.names.text_bytes_of(token_id)))
        self.texts[index] = characters, decoder
        top = None if run.top is None else [self.names.row(row) for row in run.top]
        return CompletionLogprobs(text_offset=offsets, token_logprobs=run.logprobs,
                                  tokens=[self.names(t) for t in run.token_ids], top_logprobs=top)

    def chat(self, run: TokenRun | None) -> ChatLogprobs | None:
        if run is None:
            return None
        top = run.top or [()] * len(run.token_ids)
        return ChatLogprobs(content=[
            TokenLogprob(**self._top(token, logprob), top_logprobs=[TopLogprob(**self._top(t, lp)) for t, lp in row])
            for token, logprob, row in zip(run.token_ids, run.logprobs, top)])

    def _top(self, token_id: int, logprob: float) -> dict:
        return {"token": self.names(token_id), "logprob": logprob, "bytes": list(self.names.bytes_of(token_id))}


@dataclass
class UsageCount:
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> its tokens
    completion_tokens: int = 0

    def add(self, arrival: ChoiceResponse) -> None:
        response = arrival.response
        if response.is_final:
            self.prompt_tokens[arrival.request.prompt_index] = response.num_input_tokens or 0
            self.completion_tokens += response.num_output_tokens or 0

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        return Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                     total_tokens=prompt + self.completion_tokens)


@dataclass
class Collected:
    """The whole text and finish reason of every choice, and the usage."""

    logprobs: LogprobsFormat
    texts: dict[int, list[str]] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    runs: dict[int, TokenRun] = field(default_factory=dict)  # of the choices whose request asked for logprobs
    usage: UsageCount = field(default_factory=UsageCount)

    def add(self, arrival: ChoiceResponse) -> None:
        index = arrival.request.index
        self.texts.setdefault(index, []).append(arrival.response.text)
        if (run := TokenRun.of(arrival)) is not None:
            self.runs.setdefault(index, TokenRun()).extend(run)
        if (reason := finish_reason_of(arrival)) is not None:
            self.reasons[index] = reason
        self.usage.add(arrival)

    def completion(self, response_id: str, created: int, model: str) -> Completion:
        return Completion(id=response_id, created=created, model=model, usage=self.usage.usage(), choices=[
            CompletionChoice(index=i, text="".join(self.texts[i]), finish_reason=self.reasons[i],
                             logprobs=self.logprobs.completion(i, self.runs.get(i)))
            for i in sorted(self.texts)])

    def chat_completion(self, response_id: str, created: int, model: str) -> ChatCompletion:
        return ChatCompletion(id=response_id, created=created, model=model, usage=self.usage.usage(), choices=[
            ChatChoice(index=i, message=AssistantMessage(content="".join(self.texts[i])),
                       finish_reason=self.reasons[i], logprobs=self.logprobs.chat(self.runs.get(i)))
            for i in sorted(self.texts)])


def completion_chunk(arrival: ChoiceResponse, logprobs: LogprobsFormat, response_id: str, created: int,
                     model: str) -> Completion:
    index = arrival.request.index
    return Completion(id=response_id, created=created, model=model, choices=[CompletionChoice(
        index=index, text=arrival.response.text, finish_reason=finish_reason_of(arrival),
        logprobs=logprobs.completion(index, TokenRun.of(arrival)))])


def chat_chunk(arrival: ChoiceResponse, first: bool, logprobs: LogprobsFormat, response_id: str, created: int,
               model: str) -> ChatCompletionChunk:
    delta = ChatDelta(role="assistant" if first else None, content=arrival.response.text)
    return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[ChatChunkChoice(
        index=arrival.request.index, delta=delta, finish_reason=finish_reason_of(arrival),
        logprobs=logprobs.chat(TokenRun.of(arrival)))])


def sse_event(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
