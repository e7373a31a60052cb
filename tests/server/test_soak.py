"""A bounded soak through the real server: good requests mixed with a stream of malformed and abandoned ones at
concurrency 16. No good request fails or differs from the engine, no request hangs, every bad one is refused
with a message, pages return to zero, and the server stays ready."""

import json
import random
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from served import generate, ids, metrics, post, wait_for
from tritonclient.utils import InferenceServerException

from diffulex_backend import SamplingParams
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID

CONCURRENCY = 16
REQUESTS_PER_WORKER = 12
PROMPTS = ["12+34=", "hello", "the quick brown fox", "soak", "a", "diffusion", "7*8=", "once upon a time"]
# The last one is sparse: its longer prompts drop pages while the others decode beside it.
GOOD_PARAMS = [{"max_tokens": n, "temperature": 0} for n in (4, 8, 12)] + [
    {"max_tokens": 8, "temperature": 0, "retention_ratio": 0.5}]

# One entry per class of malformed input: (generate body, a fragment of the error it must get).
MALFORMED = [
    ({"text_input": "hi", "sampling_parameters": "{max_tokens: 3"}, "is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": "[" * 5000 + "]" * 5000}, "nested more than 8 levels deep"),
    ({"text_input": "hi", "sampling_parameters": '{"seed": 1e400}'}, "sampling parameter 'seed'"),
    ({"text_input": "hi", "sampling_parameters": '{"temperature": Infinity}'}, "Infinity is not a number"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": NaN}'}, "NaN is not a number"),
    ({"text_input": "hi", "sampling_parameters": '{"top_k": 9223372036854775808}'}, "sampling parameter 'top_k'"),
    ({"text_input": "hi", "sampling_parameters": '{"temperature": 1e39}'}, "sampling parameter 'temperature'"),
    ({"text_input": "hi", "sampling_parameters": '{"seed": -1}'}, "sampling parameter 'seed'"),
    ({"text_input": "hi", "sampling_parameters": '{"seed": 18446744073709551616}'}, "sampling parameter 'seed'"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": -Infinity}'}, "-Infinity is not a number"),
    ({"text_input": "hi", "sampling_parameters": '{"stop_token_ids": [1099511627776]}'},
     "sampling parameter 'stop_token_ids'"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": 0}'}, "sampling parameter 'max_tokens'"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": 100000}'}, "exceeds max_model_len"),
    ({"text_input": "hi", "sampling_parameters": '{"stop": [1, 2]}'}, "sampling parameter 'stop'"),
    ({"text_input": "hi", "sampling_parameters": '{"confidence": {"a": 1}}'}, "sampling parameter 'confidence'"),
    ({"text_input": "hi", "sampling_parameters": '{"max_token": 3}'}, "unknown sampling parameter"),
    ({"text_input": "hi", "sampling_parameters": '{"retention_ratio": NaN}'}, "NaN is not a number"),
    ({"text_input": "hi", "sampling_parameters": '{"retention_ratio": 0}'}, "sampling parameter 'retention_ratio'"),
    ({"text_input": "hi", "sampling_parameters": '{"retention_ratio": 1e39}'}, "sampling parameter 'retention_ratio'"),
    ({"text_input": "hi", "sampling_parameters": '{"head_select": [true]}'}, "sampling parameter 'head_select'"),
    ({"text_input": "hi", "sampling_parameters": "x" * 70000}, "at most 65536 are accepted"),
    ({"text_input": "", "parameters": {"max_tokens": 4}}, "input 'text_input' is empty"),
    ({"text_input": "y" * 200_000, "parameters": {"max_tokens": 4}}, "can fit max_model_len"),
    ({"input_ids": [1, MASK_TOKEN_ID], "parameters": {"max_tokens": 4}}, "holds the mask token"),
    ({"input_ids": [1, 2**30], "parameters": {"max_tokens": 4}}, "is out of range"),
    ({"text_input": "hi", "beam_width": 4}, "input 'beam_width' must be 1"),
    ({"parameters": {"max_tokens": 4}}, "missing prompt"),
]


def good_expected(engine) -> dict:
    cases = [(prompt, i) for prompt in PROMPTS for i in range(len(GOOD_PARAMS))]
    outputs = engine.generate([p for p, _ in cases], [SamplingParams(**GOOD_PARAMS[i]) for _, i in cases])
    return {case: output.token_ids for case, output in zip(cases, outputs)}


def abandon_mid_stream(server) -> None:
    """A client that reads the first event of a long stream and hangs up."""
    body = json.dumps({"text_input": "abandoned", "stream": True, "parameters": {"max_tokens": 200}}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=120) as connection:
        connection.sendall(b"POST /v2/models/diffulex/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:
            chunk = connection.recv(4096)
            assert chunk, "the server closed the stream before its first event"
            received += chunk


def worker(server, expected: dict, seed: int) -> list[str]:
    """Runs this worker's requests; returns a description of every failure."""
    rng = random.Random(seed)
    failures = []
    for n in range(REQUESTS_PER_WORKER):
        kind = rng.choice(["good", "good", "bad", "bad", "abandon"]) if n else "good"
        try:
            if kind == "good":
                prompt, index = rng.choice(PROMPTS), rng.randrange(len(GOOD_PARAMS))
                output = generate(server, {"text_input": prompt, "parameters": GOOD_PARAMS[index],
                                           "exclude_input_in_output": True})
                if ids(output["output_ids"]) != expected[(prompt, index)]:
                    failures.append(f"good request {prompt!r} {GOOD_PARAMS[index]} gave other tokens")
            elif kind == "bad":
                body, fragment = rng.choice(MALFORMED)
                status, payload = post(f"{server.http_url}/v2/models/diffulex/generate", body)
                message = json.loads(payload).get("error", "")
                if status != 400 or fragment not in message:
                    failures.append(f"malformed {str(body)[:80]} got {status} {message[:200]!r}")
            else:
                abandon_mid_stream(server)
        except (AssertionError, OSError, InferenceServerException, ValueError) as err:
            failures.append(f"{kind}: {type(err).__name__}: {err}"[:300])
    return failures


@pytest.mark.timeout(900)
def test_good_requests_survive_a_stream_of_malformed_and_abandoned_ones(server, engine):
    expected = good_expected(engine)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        failures = sum(pool.map(lambda i: worker(server, expected, i), range(CONCURRENCY)), [])
    assert failures == []
    wait_for(lambda: metrics(server)["diffulex_kv_pages_used"] == 0, timeout_s=60)
    after = metrics(server)
    assert after["diffulex_num_requests_running"] == after["diffulex_num_requests_waiting"] == 0
    with urllib.request.urlopen(f"{server.http_url}/v2/models/diffulex/ready", timeout=10) as response:
        assert response.status == 200
