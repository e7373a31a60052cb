"""The front's settings, one per command-line option."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .request_guard import DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class FrontSettings:
    triton_url: str = "localhost:8001"  # tritonserver's gRPC address, host:port
    model: str = "diffulex"  # the Triton model served, and the name clients ask for
    tokenizer: Path | None = None  # the checkpoint directory whose tokenizer holds the chat template
    chat_template: Path | None = None  # a Jinja file that replaces the tokenizer's template
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    host: str = "127.0.0.1"
    port: int = 9000
