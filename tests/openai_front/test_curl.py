"""The front as a shell user meets it: curl, with the README's flags (-d sends a form Content-Type, which the front
reads as JSON all the same), streamed with -N."""

import json
import shutil
import subprocess

import pytest
from front_requests import API_KEY, DEMO_MODEL

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def curl(url: str, *args: str) -> str:
    return subprocess.run(["curl", "-sS", "--max-time", "60", url, *args], capture_output=True, text=True,
                          check=True).stdout


def test_curl_streams_a_chat_as_server_sent_events(demo_front):
    body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "12+34="}], "stream": True}
    output = curl(f"{demo_front.url}/v1/chat/completions", "-N", "-d", json.dumps(body))
    events = [line[len("data: "):] for line in output.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == "46"


def test_curl_gets_a_completion_and_a_model_card_with_the_key(front):
    key = ["-H", f"Authorization: Bearer {API_KEY}"]
    answer = json.loads(curl(f"{front.url}/v1/completions", *key, "-d",
                             json.dumps({"model": "diffulex", "prompt": "hello", "max_tokens": 4})))
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] <= 4
    assert json.loads(curl(f"{front.url}/v1/models/diffulex", *key))["id"] == "diffulex"
    missing = json.loads(curl(f"{front.url}/v1/models/other", *key))
    assert missing["error"]["code"] == "model_not_found"
