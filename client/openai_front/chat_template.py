"""The conversation of a chat request rendered to the model's prompt, with the checkpoint's chat template.

The template comes from the checkpoint's tokenizer (its tokenizer_config.json or chat_template.jinja, read from
local files only, never with remote code), or from a file given with --chat-template. It is rendered by
transformers' `apply_chat_template` with the generation prompt, and the rendered text is tokenized without adding
special tokens: a template writes the BOS and turn markers a model expects itself, so adding them again would double
them. The token ids go to the model as `input_ids`.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from diffulex_backend.tokenizer import load_tokenizer

from .errors import bad_request
from .schemas import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, template: str | None, reason_missing: str = ""):
        self._tokenizer = tokenizer
        self._template = template
        self._reason_missing = reason_missing  # why chat is refused, when there is no template

    @classmethod
    def load(cls, tokenizer_dir: Path | None, template_file: Path | None) -> ChatTemplate:
        if tokenizer_dir is None:
            return cls(None, None, "the server was started without --tokenizer, so it has no chat template; "
                                   "use /v1/completions")
        tokenizer = load_tokenizer(tokenizer_dir)
        if template_file is not None:
            return cls(tokenizer, Path(template_file).read_text())
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        if not template:
            return cls(tokenizer, None, f"the model's tokenizer ({tokenizer_dir}) has no chat template; start the "
                                        "server with --chat-template FILE, or use /v1/completions")
        return cls(tokenizer, template)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[ChatMessage]) -> str:
        if self._template is None:
            raise bad_request(f"chat is not available: {self._reason_missing}", param="messages",
                              code="chat_template_missing")
        conversation = [_as_template_message(message, i) for i, message in enumerate(messages)]
        try:
            text = self._tokenizer.apply_chat_template(conversation, chat_template=self._template, tokenize=False,
                                                       add_generation_prompt=True)
        except Exception as err:  # a template's own raise_exception, or a conversation it cannot render
            raise bad_request(f"the chat template cannot render these messages: {err}", param="messages") from None
        if not text:
            raise bad_request("the chat template renders these messages as an empty prompt", param="messages")
        return text

    def prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        text = self.render(messages)
        return self._tokenizer.encode(text, add_special_tokens=False)


def _as_template_message(message: ChatMessage, index: int) -> dict:
    if message.role not in ROLES:
        raise bad_request(f"messages[{index}].role must be one of {list(ROLES)}, got {message.role!r}",
                          param=f"messages[{index}].role")
    if message.model_extra:
        name = sorted(message.model_extra)[0]
        raise bad_request(f"messages[{index}].{name} is not supported", param=f"messages[{index}].{name}",
                          code="unsupported_parameter")
    rendered = {"role": message.role, "content": _text_of(message, index)}
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _text_of(message: ChatMessage, index: int) -> str:
    """A message's text: a string, or the concatenated text parts of a list of content parts."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{index}].content[{j}]: only text parts are supported",
                              param=f"messages[{index}].content[{j}]", code="unsupported_parameter")
        others = sorted(set(part) - {"type", "text"})
        if others:  # e.g. cache_control: a setting of the part that nothing here honours
            raise bad_request(f"messages[{index}].content[{j}].{others[0]} is not supported",
                              param=f"messages[{index}].content[{j}].{others[0]}", code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)
