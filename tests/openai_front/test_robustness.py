"""The front holds the Triton path's bar: a key when one is set, 413 before parsing, a client that leaves cancels its
Triton stream and frees its KV pages, and 64 streams at once all finish with every page back."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from front_requests import (
    API_KEY, DEMO_CHECKPOINT, DEMO_MODEL, error_in, error_of, generation_tokens, kv_pages_used, post,
    wait_for_kv_pages_used)

from diffulex_backend import SamplingParams
from diffulex_client.openai_front.app import create_app
from diffulex_client.openai_front.chat_template import ChatTemplate
from diffulex_client.openai_front.cli import API_KEY_VARIABLE, build_parser
from diffulex_client.openai_front.settings import FrontSettings

# About a second of decoding for the test model: long enough to leave in the middle of it.
LONG = {"model": "diffulex", "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "temperature": 0}


def test_a_missing_or_wrong_key_is_a_401_and_health_stays_open(front):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {API_KEY}"}):
        response = httpx.get(f"{front.url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert error_in(response.text)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{front.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{front.url}/health").status_code == 200


def test_the_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_VARIABLE, "from-env")
    assert build_parser().parse_args([]).api_key == "from-env"
    assert build_parser().parse_args(["--api-key", "given"]).api_key == "given"
    monkeypatch.delenv(API_KEY_VARIABLE)
    assert build_parser().parse_args([]).api_key is None


def test_a_body_over_the_limit_is_a_413_before_it_is_read(front):
    with pytest.raises(openai.APIStatusError) as caught:
        openai.OpenAI(base_url=f"{front.url}/v1", api_key=API_KEY, max_retries=0).completions.create(
            model="diffulex", prompt="x" * 300_000, max_tokens=1)
    assert caught.value.status_code == 413
    assert error_of(caught.value)["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_a_413(front):
    def chunks():
        yield b'{"model": "diffulex", "prompt": "'
        for _ in range(30):
            yield b"x" * 10_000
        yield b'"}'

    response = httpx.post(f"{front.url}/v1/completions", content=chunks(),
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 413


def test_a_body_that_declares_a_huge_length_gets_413_without_sending_it(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 5000000\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_errors_before_parsing_come_in_openais_shape(front):
    for body, status in ((b"not json", 400), (b"[1, 2]", 400), (b'{"model": "diffulex"}', 400)):
        response = post(front, "/v1/completions", body, API_KEY)
        assert response.status_code == status
        error_in(response.text)
    # The first field missing, in the order the API reference lists them.
    error = error_in(post(front, "/v1/completions", b"{}", API_KEY).text)
    assert (error["param"], error["message"]) == ("model", "model: Field required")


def test_a_client_that_leaves_a_stream_frees_its_kv_pages_and_leaves_no_task_behind(front, server):
    assert wait_for_kv_pages_used(server, 0) == 0
    sent_before = generation_tokens(server)
    log_before = front.log_path.read_text(errors="replace")
    for _ in range(3):
        with httpx.stream("POST", f"{front.url}/v1/completions", json={**LONG, "stream": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        assert wait_for_kv_pages_used(server, 0) == 0
    assert generation_tokens(server) - sent_before < 3 * LONG["max_tokens"]  # cancelled, not run to their ends
    # The handler's wait for the next response is cancelled with it: asyncio reports a task destroyed while
    # pending in the front's log otherwise.
    logged = front.log_path.read_text(errors="replace").removeprefix(log_before)
    assert "Task was destroyed but it is pending" not in logged, logged[-3000:]


def test_a_client_that_leaves_a_whole_completion_frees_its_kv_pages(front, server):
    assert wait_for_kv_pages_used(server, 0) == 0
    sent_before = generation_tokens(server)

    async def leave_early():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            task = asyncio.create_task(http.post(f"{front.url}/v1/completions", json=LONG, timeout=60))
            deadline = time.monotonic() + 30
            while kv_pages_used(server) == 0:
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_early())
    assert wait_for_kv_pages_used(server, 0) == 0
    assert generation_tokens(server) - sent_before < LONG["max_tokens"]  # cancelled, not run to its end


def test_64_concurrent_streams_all_finish_and_every_page_comes_back(front, server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await client.completions.create(model="diffulex", prompt=f"prompt {i}", max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, reason, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            else:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=64)))
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert [(reason, tokens) for _, reason, tokens in results] == [("length", 8)] * 64
    singles = {i: results[i][0] for i in (0, 63)}
    for i, text in singles.items():  # a stream among 64 has the text it has alone
        alone = post(front, "/v1/completions", {**LONG, "prompt": f"prompt {i}", "max_tokens": 8}, API_KEY).json()
        assert alone["choices"][0]["text"] == text
    assert wait_for_kv_pages_used(server, 0) == 0


def test_a_tokenizer_or_template_that_cannot_be_read_stops_the_command_with_a_usage_error(tmp_path):
    for args in (["--tokenizer", str(tmp_path / "none")],
                 ["--tokenizer", str(DEMO_CHECKPOINT), "--chat-template", str(tmp_path / "none.jinja")]):
        done = subprocess.run([sys.executable, "-m", "diffulex_client.openai_front", *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2
        assert "cannot read the chat template" in done.stderr and "none" in done.stderr


def test_a_client_that_leaves_after_one_choice_ended_frees_the_others_pages(front, server, engine):
    """One choice stops early on a stop string, the other is still decoding when the client leaves: the open one is
    cancelled and the ended one's call is closed by the server (the session's server must still unload cleanly)."""
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    short, long = (engine.generate([p], params)[0].text for p in ("hello", "goodbye"))
    stop = next(short[i:i + 3] for i in range(4, len(short)) if short[i:i + 3] not in long)
    assert wait_for_kv_pages_used(server, 0) == 0
    sent_before = generation_tokens(server)
    body = {**LONG, "prompt": ["hello", "goodbye"], "stop": [stop], "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"finish_reason":"stop"' in line:
                break  # the short choice ended; the long one decodes on
    assert wait_for_kv_pages_used(server, 0) == 0
    assert generation_tokens(server) - sent_before < LONG["max_tokens"]  # the long one was cancelled


def test_a_client_that_stops_reading_a_stream_and_then_leaves_frees_its_kv_pages_at_once(front, server):
    """A client that stops reading with a window of 2 KB: the front's writes to it wait once the sockets' and the
    server's buffers are full (under 200 KB). When it then closes its connection, the streams' Triton calls are
    cancelled at once, not when the response is collected, and their pages come back."""
    assert wait_for_kv_pages_used(server, 0) == 0
    sent_before = generation_tokens(server)
    prompts = ["hello", "goodbye", "again", "once more"]
    body = json.dumps({**LONG, "prompt": prompts, "stream": True, "logprobs": 5}).encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: the window it offers
        sock.settimeout(30)
        sock.connect(("127.0.0.1", front.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        # Nothing more is read while half the tokens decode: with 5 alternatives each, some 280 KB of events (the
        # whole stream is 560 KB).
        deadline = time.monotonic() + 30
        while generation_tokens(server) - sent_before < len(prompts) * LONG["max_tokens"] // 2:
            assert time.monotonic() < deadline, "the streams never got that far"
            time.sleep(0.02)
    left = time.monotonic()
    assert wait_for_kv_pages_used(server, 0, timeout_s=5) == 0
    assert time.monotonic() - left < 2.0, "the pages came back only after the streams would have ended anyway"
    assert generation_tokens(server) - sent_before < len(prompts) * LONG["max_tokens"]  # cancelled, not run out
    # The next client is served whole.
    after = post(front, "/v1/completions", {**LONG, "max_tokens": 8}, API_KEY)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8


def test_a_client_that_leaves_while_sending_its_body_gets_one_line_of_log_and_no_error(front):
    """A client that declares 100 bytes of body, sends 9 and closes: the front logs one line that says so, no
    error and no traceback (which a client could repeat to flood the log), and serves on."""
    log_before = front.log_path.read_text(errors="replace")
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\":")
    deadline = time.monotonic() + 10
    while "before its request on" not in front.log_path.read_text(errors="replace").removeprefix(log_before):
        assert time.monotonic() < deadline, front.log_tail()
        time.sleep(0.05)
    assert post(front, "/v1/completions", {**LONG, "max_tokens": 4}, API_KEY).status_code == 200
    logged = front.log_path.read_text(errors="replace").removeprefix(log_before)
    assert "ERROR" not in logged and "Traceback" not in logged, logged[-3000:]


class HeldTemplate(ChatTemplate):
    """The demo checkpoint's chat template, whose tokenizing of a conversation waits until the test releases it, as
    a conversation of a megabyte keeps it busy for seconds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.released = threading.Event(), threading.Event()

    def prompt_ids(self, messages):
        self.entered.set()
        assert self.released.wait(60), "never released"
        return super().prompt_ids(messages)


def test_a_conversation_being_tokenized_holds_up_no_other_request(server, demo_front):
    """While one chat's conversation is rendered and tokenized, the front answers /health and completions at once,
    and the chat is answered when its tokenizing ends. On the event loop the tokenizing held up every request."""
    template = HeldTemplate.load(DEMO_CHECKPOINT, None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = FrontSettings(triton_url=server.grpc_url, model=DEMO_MODEL, port=port)
    front = uvicorn.Server(uvicorn.Config(create_app(settings, template), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=front.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not front.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the front never started"
            time.sleep(0.05)
        with ThreadPoolExecutor(1) as pool:
            chat = pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=60, json={
                "model": DEMO_MODEL, "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 8,
                "ignore_eos": True})
            try:
                assert template.entered.wait(30), "the chat never reached its tokenizing"
                assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ready"
                completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
                    "model": DEMO_MODEL, "prompt": "12+34=", "max_tokens": 8, "ignore_eos": True})
                assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 8
                assert not chat.done()
            finally:
                template.released.set()
            answer = chat.result()
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
    finally:
        front.should_exit = True
        thread.join(30)
