"""The `diffulex-client` command end to end, in a subprocess against the real server."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from served_model import kv_pages_used, url_for, wait_for_kv_pages_used
from triton_server import free_ports

from diffulex_client import DiffulexClient
from diffulex_client.cli import ExitCode

COMMAND = Path(sys.executable).parent / "diffulex-client"  # the console script that pyproject.toml declares
PROMPT = "Once upon a time"
MAX_TOKENS = 12


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(COMMAND), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def expected(server, protocol):
    return DiffulexClient(url_for(server, protocol), protocol).generate(PROMPT, max_tokens=MAX_TOKENS)


def test_generate_prints_the_completion_text(server, protocol, expected):
    result = run_cli("generate", PROMPT, "--max-tokens", str(MAX_TOKENS), "--url", url_for(server, protocol),
                     "--protocol", protocol)
    assert (result.returncode, result.stdout, result.stderr) == (ExitCode.OK, expected.text + "\n", "")


def test_generate_json_prints_the_final_record(server, protocol, expected):
    result = run_cli("generate", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json",
                     "--url", url_for(server, protocol), "--protocol", protocol)
    assert result.returncode == ExitCode.OK, result.stderr
    assert json.loads(result.stdout) == expected.to_dict()


def test_stream_prints_the_same_text(server, protocol, expected):
    result = run_cli("generate", PROMPT, "--stream", "--max-tokens", str(MAX_TOKENS), "--url", url_for(server, protocol),
                     "--protocol", protocol)
    assert (result.returncode, result.stdout) == (ExitCode.OK, expected.text + "\n")


def test_stream_json_prints_deltas_then_the_final_record(server, protocol, expected):
    result = run_cli("generate", PROMPT, "--stream", "--json", "--max-tokens", str(MAX_TOKENS),
                     "--url", url_for(server, protocol), "--protocol", protocol)
    assert result.returncode == ExitCode.OK, result.stderr
    *deltas, record = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(deltas) > 1
    assert "".join(delta["delta"] for delta in deltas) == expected.text
    assert record == expected.to_dict()


def test_server_error_exits_1_with_the_servers_message(server):
    result = run_cli("generate", PROMPT, "--max-tokens", "1000", "--url", server.grpc_url)
    assert result.returncode == ExitCode.SERVER_ERROR == 1
    assert result.stdout == ""
    assert result.stderr == ("diffulex-client: server error: prompt has 16 tokens and max_tokens is 1000: "
                             "16 + 1000 = 1016 exceeds max_model_len (512)\n")


def test_an_unknown_model_exits_1_with_the_servers_message(server, protocol):
    result = run_cli("generate", PROMPT, "--url", url_for(server, protocol), "--protocol", protocol, "--model", "nope")
    assert result.returncode == ExitCode.SERVER_ERROR == 1
    assert "Request for unknown model: 'nope' is not found" in result.stderr, result.stderr


def test_connection_refused_exits_3(protocol):
    url = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    for command in (["generate", PROMPT], ["health"]):
        result = run_cli(*command, "--url", url, "--protocol", protocol)
        assert result.returncode == ExitCode.CONNECTION_FAILED == 3
        assert result.stderr.startswith("diffulex-client: connection failed: ")


def started_as_a_foreground_job(command: list[str]) -> subprocess.Popen:
    """The command with SIGINT at its default, as a terminal's foreground job gets it, however the suite was started:
    a suite run in the background (`make test &`) ignores SIGINT, and an ignored signal stays ignored across exec,
    where a handled one goes back to its default."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_cancels_the_request_on_the_server(server):
    assert wait_for_kv_pages_used(server, 0) == 0
    process = started_as_a_foreground_job(
        [str(COMMAND), "generate", PROMPT, "--stream", "--max-tokens", "400",
         "--sampling-parameters", '{"ignore_eos": true}', "--url", server.grpc_url])
    try:
        process.stdout.read(1)  # the first delta is out: the request is decoding
        assert kv_pages_used(server) > 0
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == ExitCode.INTERRUPTED == 130
    assert stderr == "diffulex-client: interrupted; the request was cancelled\n"
    assert wait_for_kv_pages_used(server, 0) == 0


def test_health_prints_readiness_and_engine_settings(server, checkpoint):
    result = run_cli("health", "--url", server.grpc_url, "--metrics-url", server.metrics_url)
    assert result.returncode == ExitCode.OK, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == [f"server {server.grpc_url} (grpc): live yes, ready yes", "model diffulex: ready yes"]
    assert lines[2].startswith("engine settings, resolved by ")
    assert ["block_size", "4"] in [line.split() for line in lines[3:]]
    assert ["model", str(checkpoint)] in [line.split() for line in lines[3:]]
    assert ["device", "cuda:0" if torch.cuda.is_available() else "cpu"] in [line.split() for line in lines[3:]]

    # Without a reachable metrics endpoint it shows config.pbtxt as written, and says so.
    unreachable = f"http://127.0.0.1:{free_ports(1)[0]}/metrics"
    result = run_cli("health", "--url", server.grpc_url, "--metrics-url", unreachable)
    lines = result.stdout.splitlines()
    assert result.returncode == ExitCode.OK, result.stderr
    assert lines[2] == "engine settings (config.pbtxt; the metrics endpoint was not reachable):"
    assert ["device", "auto"] in [line.split() for line in lines[3:]]

    result = run_cli("health", "--json", "--url", url_for(server, "http"), "--protocol", "http")
    record = json.loads(result.stdout)
    assert record["ok"] and record["engine_settings"]["page_size"] == "4"


def test_health_of_an_unknown_model_exits_5(server):
    result = run_cli("health", "--url", server.grpc_url, "--model", "no_such_model")
    assert result.returncode == ExitCode.NOT_READY == 5
    assert result.stdout.splitlines()[1] == "model no_such_model: ready no"


def test_help_documents_the_exit_codes():
    result = run_cli("generate", "--help")
    assert result.returncode == ExitCode.OK
    for code in ExitCode:
        assert f"\n  {int(code):<4} " in result.stdout
