"""The `diffulex-client` command: generate text from, or check the health of, a diffulex server."""

from __future__ import annotations

import argparse
import enum
import json
import sys

from .client import DEFAULT_MODEL, DiffulexClient
from .errors import DiffulexConnectionError, DiffulexServerError, DiffulexTimeoutError
from .protocol import Protocol


class ExitCode(enum.IntEnum):
    OK = 0
    SERVER_ERROR = 1
    USAGE = 2  # argparse's own
    CONNECTION_FAILED = 3
    TIMED_OUT = 4
    NOT_READY = 5
    INTERRUPTED = 130  # 128 + SIGINT, as shells report it


EXIT_CODES_HELP = f"""exit status:
  {ExitCode.OK:<4} success
  {ExitCode.SERVER_ERROR:<4} the server answered with an error (its message is printed on stderr)
  {ExitCode.USAGE:<4} bad command line
  {ExitCode.CONNECTION_FAILED:<4} the server could not be reached, or the connection broke
  {ExitCode.TIMED_OUT:<4} no final response within --timeout
  {ExitCode.NOT_READY:<4} health: the server or the model is not ready
  {ExitCode.INTERRUPTED:<4} interrupted (Ctrl-C); the request was cancelled on the server"""


def build_parser() -> argparse.ArgumentParser:
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--url", help="host:port of the server (default: localhost:8001 for grpc, "
                                          "localhost:8000 for http)")
    connection.add_argument("--protocol", choices=[p.value for p in Protocol], default=Protocol.GRPC.value)
    connection.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default: {DEFAULT_MODEL})")
    connection.add_argument("--timeout", type=float, help="seconds a request may take (default: no limit)")
    connection.add_argument("--json", action="store_true", help="print JSON records instead of text")

    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="diffulex-client", description=__doc__, epilog=EXIT_CODES_HELP,
                                     formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser(
        "generate", parents=[connection], formatter_class=formatter, epilog=EXIT_CODES_HELP,
        help="generate a completion for a prompt",
        description="Generate a completion. With --json, print the final record (text, finish_reason, "
                    "num_input_tokens, num_output_tokens, nfe) as one JSON object; with --stream as well, "
                    'first print each text delta as a {"delta": ...} line as it arrives.')
    generate.add_argument("prompt")
    generate.add_argument("--stream", action="store_true", help="print text as the model commits it")
    generate.add_argument("--max-tokens", type=int, help="most tokens to generate")
    generate.add_argument("--temperature", type=float, help="0 decodes greedily")
    generate.add_argument("--sampling-parameters", type=json.loads, default={}, metavar="JSON",
                          help='any other sampling parameters as a JSON object, e.g. \'{"seed": 1, "stop": ["\\n"]}\'')

    health = commands.add_parser(
        "health", parents=[connection], formatter_class=formatter, epilog=EXIT_CODES_HELP,
        help="report server and model readiness, and the engine settings as resolved",
        description="Report whether the server is live and ready, whether the model is ready, and the "
                    "settings each instance's engine resolved (the device, dtype and KV pages it chose), read from "
                    "Triton's metrics endpoint; where that cannot be reached, the config.pbtxt parameters as "
                    "written.")
    health.add_argument("--metrics-url", help="Triton's metrics endpoint (default: http://HOST:8002/metrics, HOST "
                                              "from --url)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = DiffulexClient(args.url, args.protocol, args.model, args.timeout)
    try:
        if args.command == "health":
            return report_health(client, args.json, args.metrics_url)
        return generate(client, args)
    except DiffulexServerError as err:
        return fail(ExitCode.SERVER_ERROR, f"server error: {err.message}")
    except DiffulexConnectionError as err:
        return fail(ExitCode.CONNECTION_FAILED, f"connection failed: {err}")
    except DiffulexTimeoutError as err:
        return fail(ExitCode.TIMED_OUT, f"timed out: {err}")
    except KeyboardInterrupt:  # the stream was closed on the way out, which cancelled the request
        return fail(ExitCode.INTERRUPTED, "interrupted; the request was cancelled")


def generate(client: DiffulexClient, args: argparse.Namespace) -> int:
    sampling = dict(args.sampling_parameters)
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if not args.stream:
        completion = client.generate(args.prompt, **sampling)
        print(json.dumps(completion.to_dict()) if args.json else completion.text)
        return ExitCode.OK
    with client.stream(args.prompt, **sampling) as stream:
        for delta in stream:
            print(json.dumps({"delta": delta}) if args.json else delta, end="\n" if args.json else "", flush=True)
    print(json.dumps(stream.completion.to_dict()) if args.json else "")
    return ExitCode.OK


def report_health(client: DiffulexClient, as_json: bool, metrics_url: str | None = None) -> int:
    health = client.health(metrics_url)
    if as_json:
        print(json.dumps(health.to_dict()))
    else:
        def yes_no(value: bool) -> str:
            return "yes" if value else "no"

        print(f"server {client.url} ({client.protocol.value}): live {yes_no(health.server_live)}, "
              f"ready {yes_no(health.server_ready)}")
        print(f"model {client.model}: ready {yes_no(health.model_ready)}")
        def print_settings(settings: dict[str, str]) -> None:
            width = max(map(len, settings))
            for name, value in sorted(settings.items()):
                print(f"  {name:<{width}}  {value if value else '(unset)'}")

        for instance, settings in sorted(health.resolved_settings.items()):
            print(f"engine settings, resolved by {instance}:")
            print_settings(settings)
        if health.engine_settings and not health.resolved_settings:
            print("engine settings (config.pbtxt; the metrics endpoint was not reachable):")
            print_settings(health.engine_settings)
    return ExitCode.OK if health.ok else ExitCode.NOT_READY


def fail(code: ExitCode, message: str) -> int:
    print(f"diffulex-client: {message}", file=sys.stderr)
    return code
