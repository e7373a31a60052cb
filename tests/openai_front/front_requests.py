"""What the front's tests read: OpenAI's error shape, raw HTTP answers, and the model's KV-pages gauge."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import httpx
import openai

API_KEY = "test-key"  # the key the session's front requires
DEMO_MODEL = "diffulex_openai_demo"  # the shipped demo model, loaded under this name for the chat tests
DEMO_CHECKPOINT = Path(__file__).resolve().parents[2] / "model_repository" / "diffulex" / "demo-llada"
KV_PAGES_USED = re.compile(r'^diffulex_kv_pages_used\{[^}]*\bmodel="diffulex"[^}]*\} (\S+)$', re.M)


def error_of(err: openai.APIStatusError) -> dict:
    """OpenAI's error object from an SDK exception, checked for its shape."""
    return error_in(err.response.text)


def error_in(text: str) -> dict:
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def post(front, path: str, body, api_key: str | None = None, timeout: float = 120) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body, allow_nan=True)
    return httpx.post(f"{front.url}{path}", content=content, headers=headers, timeout=timeout)


GENERATION_TOKENS = re.compile(r'^diffulex_generation_tokens_total\{[^}]*\bmodel="diffulex"[^}]*\} (\S+)$', re.M)


def _metric(server, pattern: re.Pattern) -> int:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        match = pattern.search(response.read().decode())
    assert match, f"the server exports no {pattern.pattern.split('{')[0].lstrip('^')}"
    return int(float(match.group(1)))


def prefix_cache_tokens(server) -> tuple[int, int]:
    """The model's prefix-cache counters: prompt tokens found in the cache, and prompt tokens looked up."""
    return tuple(_metric(server, re.compile(rf'^diffulex_prefix_cache_{kind}_tokens_total\{{[^}}]*\bmodel="diffulex"'
                                            r'[^}]*\} (\S+)$', re.M)) for kind in ("hit", "queried"))


def kv_pages_used(server) -> int:
    return _metric(server, KV_PAGES_USED)


def generation_tokens(server) -> int:
    """Tokens the model has sent, all requests together."""
    return _metric(server, GENERATION_TOKENS)


def wait_for_kv_pages_used(server, expected: int, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := kv_pages_used(server)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return used
