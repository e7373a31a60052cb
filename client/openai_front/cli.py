"""The `diffulex-openai` command: the OpenAI-compatible front, in front of a tritonserver that serves diffulex."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn

from .app import create_app
from .chat_template import ChatTemplate
from .request_guard import DEFAULT_MAX_BODY_BYTES
from .settings import FrontSettings

API_KEY_VARIABLE = "DIFFULEX_OPENAI_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    defaults = FrontSettings()
    parser = argparse.ArgumentParser(prog="diffulex-openai", description=__doc__)
    parser.add_argument("--triton-url", default=defaults.triton_url,
                        help=f"tritonserver's gRPC address, host:port (default: {defaults.triton_url})")
    parser.add_argument("--model", default=defaults.model,
                        help=f"the Triton model to serve, and its name in the API (default: {defaults.model})")
    parser.add_argument("--tokenizer", type=Path,
                        help="the model's checkpoint directory, whose tokenizer holds the chat template; "
                             "without it only /v1/completions answers")
    parser.add_argument("--chat-template", type=Path, help="a Jinja chat template file that replaces the tokenizer's")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: the environment's "
                             f"{API_KEY_VARIABLE}, which keeps the key out of the process list)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"larger request bodies get 413 before they are read (default: {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--host", default=defaults.host, help=f"address to listen on (default: {defaults.host})")
    parser.add_argument("--port", type=int, default=defaults.port, help=f"port to listen on (default: {defaults.port})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_body_bytes < 1:
        parser.error("--max-body-bytes must be positive")
    settings = FrontSettings(triton_url=args.triton_url, model=args.model, tokenizer=args.tokenizer,
                             chat_template=args.chat_template, api_key=args.api_key,
                             max_body_bytes=args.max_body_bytes, host=args.host, port=args.port)
    try:
        template = ChatTemplate.load(settings.tokenizer, settings.chat_template)
    except (OSError, ValueError) as err:  # a missing folder or file, or a tokenizer transformers cannot read
        parser.error(f"cannot read the chat template: {err}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Open streams get a few seconds to end on SIGTERM; those still open are then cancelled, on Triton too.
    uvicorn.run(create_app(settings, template), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=5)
    return 0
