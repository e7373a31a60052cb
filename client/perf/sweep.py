"""Load-test the diffulex model with perf_analyzer over gRPC streaming, at a sweep of concurrencies.

    python -m diffulex_client.perf.sweep [--url localhost:8001] [--input-data client/perf/medium_streaming.json]
        [--concurrency 1 2 4 8] [--requests-per-window 16] [--output-dir build/perf]

When no server answers at --url, one is started on the repository's model_repository (the demo model),
with gRPC on --url's port and HTTP and metrics on --http-port and --metrics-port, and stopped at the end.
Each concurrency level is one perf_analyzer run in count windows that exports its profile to the output
folder; the table printed at the end is computed from those exports (report.py).

perf_analyzer is the binary that the tritonclient wheel installs beside this Python. It needs libb64
(Debian's libb64-0d) and libcudart.so.12, which PyPI's nvidia-cuda-runtime-cu12 provides even without a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from diffulex_client import DiffulexClient, DiffulexConnectionError
from diffulex_client.perf.report import format_table, load_summaries

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT_S = 300  # the Python backend imports torch twice before the model is ready
SERVER_STOP_TIMEOUT_S = 90


def perf_analyzer_path() -> str:
    beside_python = Path(sys.executable).parent / "perf_analyzer"
    found = str(beside_python) if beside_python.is_file() else shutil.which("perf_analyzer")
    if found is None:
        raise SystemExit("perf_analyzer not found: install tritonclient[all]==2.51.0")
    return found


def perf_analyzer_env() -> dict[str, str]:
    """The environment with nvidia-cuda-runtime-cu12's libcudart.so.12 on the library path, when installed."""
    env = os.environ.copy()
    try:
        import nvidia.cuda_runtime
    except ImportError:  # a machine with the CUDA toolkit has its own libcudart
        return env
    lib = os.pathsep.join(str(Path(folder) / "lib") for folder in nvidia.cuda_runtime.__path__)
    env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def run_perf_analyzer(url: str, model: str, input_data: Path, concurrency: int, requests_per_window: int,
                      export_path: Path, stability_percentage: float, max_trials: int) -> subprocess.CompletedProcess:
    """One concurrency level. perf_analyzer refuses to overwrite an export, so an old one is removed."""
    export_path.unlink(missing_ok=True)
    command = [
        perf_analyzer_path(), "-m", model, "-u", url, "-i", "grpc", "--streaming",
        "--input-data", str(input_data), "--concurrency-range", str(concurrency),
        "--measurement-mode", "count_windows", "--measurement-request-count", str(requests_per_window),
        "--stability-percentage", str(stability_percentage), "--max-trials", str(max_trials),
        "--profile-export-file", str(export_path),
    ]
    return subprocess.run(command, capture_output=True, text=True, env=perf_analyzer_env())


class LocalServer:
    """A tritonserver on the repository's model_repository, for the length of the sweep."""

    def __init__(self, grpc_port: int, http_port: int, metrics_port: int, log_path: Path):
        launcher = Path(sys.executable).parent / "tritonserver"  # written by `make setup`
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.process = subprocess.Popen(
            [str(launcher), "--model-repository", str(REPOSITORY_ROOT / "model_repository"),
             "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port)],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, client: DiffulexClient) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"tritonserver exited with {self.process.returncode}; see {self.log_path}")
            try:
                if client.health().ok:
                    return
            except DiffulexConnectionError:
                pass
            time.sleep(1)
        raise SystemExit(f"tritonserver was not ready within {SERVER_START_TIMEOUT_S} s; see {self.log_path}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def server_answers(client: DiffulexClient) -> bool:
    """Whether a server answers at the client's address; one that answers must serve the model."""
    try:
        health = client.health()
    except DiffulexConnectionError:
        return False
    if not health.ok:
        raise SystemExit(f"the server at {client.url} answers, but model {client.model} is not ready")
    return True


def sweep(args: argparse.Namespace) -> list[Path]:
    exports = []
    for concurrency in args.concurrency:
        export_path = args.output_dir / f"profile_concurrency_{concurrency}.json"
        print(f"perf_analyzer at concurrency {concurrency} ...", flush=True)
        result = run_perf_analyzer(args.url, args.model, args.input_data, concurrency,
                                   max(args.requests_per_window, 4 * concurrency), export_path,
                                   args.stability_percentage, args.max_trials)
        (args.output_dir / f"perf_analyzer_concurrency_{concurrency}.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise SystemExit(f"perf_analyzer failed at concurrency {concurrency}:\n{result.stdout[-4000:]}"
                             f"{result.stderr[-4000:]}")
        exports.append(export_path)
    return exports


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m diffulex_client.perf.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="gRPC host:port of the server")
    parser.add_argument("--model", default="diffulex")
    parser.add_argument("--input-data", type=Path, default=Path(__file__).parent / "medium_streaming.json")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests-per-window", type=int, default=16,
                        help="least requests per count window (at least four times the concurrency is used)")
    # perf_analyzer repeats windows until the last three agree within this many percent; CPU timings are
    # noisy, so the default is loose.
    parser.add_argument("--stability-percentage", type=float, default=50)
    parser.add_argument("--max-trials", type=int, default=10)
    parser.add_argument("--output-dir", type=Path, default=REPOSITORY_ROOT / "build" / "perf")
    parser.add_argument("--http-port", type=int, default=8000, help="for a server started here")
    parser.add_argument("--metrics-port", type=int, default=8002, help="for a server started here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    client = DiffulexClient(args.url, "grpc", args.model, timeout=30)
    server = None
    if not server_answers(client):
        print(f"no server at {args.url}: starting tritonserver on model_repository", flush=True)
        server = LocalServer(int(args.url.rpartition(":")[2]), args.http_port, args.metrics_port,
                             args.output_dir / "tritonserver.log")
    try:
        if server is not None:
            server.wait_ready(client)
        exports = sweep(args)
    finally:
        if server is not None:
            server.stop()
    print(f"\n{args.input_data.name}, gRPC streaming, model {args.model} at {args.url}; exports in {args.output_dir}")
    print(format_table(load_summaries([str(path) for path in exports])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
