"""OpenAI response bodies built from the model's responses: whole completions, streamed chunks and usage.

The model's final response of each choice carries its finish reason and token counts. Usage counts each prompt's
tokens once, however many choices it has, and adds up the tokens of every choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http import HTTPStatus

from .errors import OpenAIError
from .generation import ChoiceResponse
from .schemas import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, Completion,
    CompletionChoice, Usage)

FINISH_REASONS = ("stop", "length")


def finish_reason_of(arrival: ChoiceResponse) -> str | None:
    reason = arrival.response.finish_reason
    if reason is not None and reason not in FINISH_REASONS:
        raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"the model ended choice {arrival.request.index} with "
                          f"finish reason '{reason}'", code="model_not_ready")
    return reason


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

    texts: dict[int, list[str]] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    usage: UsageCount = field(default_factory=UsageCount)

    def add(self, arrival: ChoiceResponse) -> None:
        index = arrival.request.index
        self.texts.setdefault(index, []).append(arrival.response.text)
        if (reason := finish_reason_of(arrival)) is not None:
            self.reasons[index] = reason
        self.usage.add(arrival)

    def completion(self, response_id: str, created: int, model: str) -> Completion:
        return Completion(id=response_id, created=created, model=model, usage=self.usage.usage(), choices=[
            CompletionChoice(index=i, text="".join(self.texts[i]), finish_reason=self.reasons[i])
            for i in sorted(self.texts)])

    def chat_completion(self, response_id: str, created: int, model: str) -> ChatCompletion:
        return ChatCompletion(id=response_id, created=created, model=model, usage=self.usage.usage(), choices=[
            ChatChoice(index=i, message=AssistantMessage(content="".join(self.texts[i])),
                       finish_reason=self.reasons[i])
            for i in sorted(self.texts)])


def completion_chunk(arrival: ChoiceResponse, response_id: str, created: int, model: str) -> Completion:
    return Completion(id=response_id, created=created, model=model, choices=[CompletionChoice(
        index=arrival.request.index, text=arrival.response.text, finish_reason=finish_reason_of(arrival))])


def chat_chunk(arrival: ChoiceResponse, first: bool, response_id: str, created: int,
               model: str) -> ChatCompletionChunk:
    delta = ChatDelta(role="assistant" if first else None, content=arrival.response.text)
    return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[ChatChunkChoice(
        index=arrival.request.index, delta=delta, finish_reason=finish_reason_of(arrival))])


def sse_event(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
