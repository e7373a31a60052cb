"""Profiling on demand through a real tritonserver: a request with profile_steps gets its usual answer, and the model
writes a trace of the steps it asked for into config.pbtxt's profile_dir, naming the file in the server's log."""
from __future__ import annotations

import json

from served import generate, ids
from triton_server import SHUTDOWN_TIMEOUT_S, STARTUP_TIMEOUT_S, TEST_SETTINGS, TritonServer, add_model

from diffulex_backend import SamplingParams


def test_a_request_with_profile_steps_is_answered_and_leaves_a_trace(tmp_path, checkpoint, engine):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    repository = tmp_path / "repository"
    add_model(repository, "diffulex", model=checkpoint, profile_dir=profiles, **TEST_SETTINGS)
    [expected] = engine.generate(["12+34="], SamplingParams(max_tokens=16))
    server = TritonServer(repository, tmp_path / "tritonserver.log")
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        answer = generate(server, {"text_input": "12+34=", "exclude_input_in_output": True,
                                   "parameters": {"max_tokens": 16, "profile_steps": 2}})
        assert (ids(answer["output_ids"]), answer["text_output"]) == (expected.token_ids, expected.text)
        assert expected.nfe > 2  # so the recording ended at its count, before the answer was sent
        [trace] = profiles.glob("diffulex-steps-*.json")
        names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        assert [names.count(name) for name in ("schedule", "forward", "sample", "accept")] == [2, 2, 2, 2]
        assert f"recorded 2 engine steps into {trace}" in server.log_tail(20000)
    finally:
        assert server.stop(SHUTDOWN_TIMEOUT_S) == 0, server.log_tail()
