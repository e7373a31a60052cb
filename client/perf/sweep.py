"""Load-test the diffulex model with perf_analyzer over gRPC streaming, at a sweep of concurrencies.

    python -m diffulex_client.perf.sweep [--url localhost:8001] [--input-data client/perf/medium_streaming.json]
        [--concurrency 1 2 4 8] [--requests-per-window 16] [--output-dir build/perf]

When no server answers at --url, one is started on the repository's model_repository (the demo model),
with gRPC on --url's port and HTTP and metrics on --http-port and --metrics-port, and stopped at the end
(tritonserver.py). Each concurrency level is one perf_analyzer run in count windows that exports its profile
to the output folder; the table printed at the end is computed from those exports (report.py). When a level
fails, the levels after it are not run: the table of the finished ones is printed, then the failure, and the
exit status is 1.

perf_analyzer is the binary that the tritonclient wheel installs beside this Python. It needs libb64
(Debian's libb64-0d) and libcudart.so.12, which PyPI's nvidia-cuda-runtime-cu12 provides even without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from diffulex_client import DiffulexClient, DiffulexConnectionError
from diffulex_client.perf.report import format_table, load_summaries
from diffulex_client.perf.tritonserver import MODEL_REPOSITORY, REPOSITORY_ROOT, TritonServer


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


# perf_analyzer runs made for one measurement while each leaves a broken export (see export_is_whole). Which runs
# break depends on each process's heap addresses, so a second run is very likely whole; a third is a margin.
EXPORT_ATTEMPTS = 3


def export_is_whole(export_path: Path) -> bool:
    """Whether perf_analyzer's profile export exists and parses as one whole JSON document.

    perf_analyzer 2.51 (tritonclient 2.51.0, the newest whose binary runs on glibc 2.36) can leave an export that is
    empty or cut short after exiting 0. It records every output the model declares from each response, and for one a
    response leaves out (log_probs, output_log_probs, cum_log_probs and top_log_probs unless a request asks for them;
    num_output_tokens and the like before the final response) it keeps a zero-byte copy, from which its exporter then
    reads one number anyway: heap garbage, which exports show as log_probs values such as -3.6e+35. When the four
    garbage bytes of an FP32 output happen to be a NaN or an infinity, rapidjson's writer refuses the number and stops
    writing; perf_analyzer ignores that, closes the file and exits 0. The file then holds only the 64 KiB chunks its
    write buffer had flushed: nothing for a short run, else exactly a multiple of 65,536 bytes, whose last JSON value is
    cut mid-way. perf_analyzer 2.52 exports a left-out output as "" (triton-inference-server/perf_analyzer#153), but it
    needs glibc 2.38. Whole exports are unaffected: the garbage never reaches report.py's own fields, which it reads
    from the final response only (num_output_tokens) or from the timestamps."""
    try:
        with open(export_path, encoding="utf-8") as export:
            json.load(export)
    except (OSError, ValueError):  # ValueError: JSONDecodeError, or UnicodeDecodeError on a cut multi-byte character
        return False
    return True


def run_perf_analyzer(url: str, model: str, input_data: Path, concurrency: int, requests_per_window: int,
                      export_path: Path, stability_percentage: float, max_trials: int) -> subprocess.CompletedProcess:
    """One concurrency level. perf_analyzer refuses to overwrite an export, so an old one is removed.

    perf_analyzer 2.51 can exit 0 with its measurements printed and an export that is empty or cut short
    (`export_is_whole` says why): such a run is made again, up to EXPORT_ATTEMPTS runs in all, and when none leaves
    a whole export the result is a failure (exit 1) that says so."""
    command = [
        perf_analyzer_path(), "-m", model, "-u", url, "-i", "grpc", "--streaming",
        "--input-data", str(input_data), "--concurrency-range", str(concurrency),
        "--measurement-mode", "count_windows", "--measurement-request-count", str(requests_per_window),
        "--stability-percentage", str(stability_percentage), "--max-trials", str(max_trials),
        "--profile-export-file", str(export_path),
    ]
    for _ in range(EXPORT_ATTEMPTS):
        export_path.unlink(missing_ok=True)
        result = subprocess.run(command, capture_output=True, text=True, env=perf_analyzer_env())
        if result.returncode != 0 or export_is_whole(export_path):
            return result
    return subprocess.CompletedProcess(
        command, 1, result.stdout, result.stderr + f"\nperf_analyzer exited 0 {EXPORT_ATTEMPTS} times without "
        f"writing a whole export to {export_path} (empty or cut short: see export_is_whole)")


def server_answers(client: DiffulexClient) -> bool:
    """Whether a server answers at the client's address; one that answers must serve the model."""
    try:
        health = client.health()
    except DiffulexConnectionError:
        return False
    if not health.ok:
        raise SystemExit(f"the server at {client.url} answers, but model {client.model} is not ready")
    return True


def sweep(args: argparse.Namespace) -> tuple[list[Path], str | None]:
    """The exports of the levels that finished, in order, and the error of the level that failed, if one did;
    the levels after a failed one are not run."""
    exports = []
    for concurrency in args.concurrency:
        export_path = args.output_dir / f"profile_concurrency_{concurrency}.json"
        print(f"perf_analyzer at concurrency {concurrency} ...", flush=True)
        result = run_perf_analyzer(args.url, args.model, args.input_data, concurrency,
                                   max(args.requests_per_window, 4 * concurrency), export_path,
                                   args.stability_percentage, args.max_trials)
        (args.output_dir / f"perf_analyzer_concurrency_{concurrency}.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            return exports, (f"perf_analyzer failed at concurrency {concurrency} (exit {result.returncode}):\n"
                             f"{result.stdout[-4000:]}{result.stderr[-4000:]}")
        exports.append(export_path)
    return exports, None


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
    """0 when every level finished. When one fails, the finished levels' table is still printed, then the
    error, and the status is 1."""
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    client = DiffulexClient(args.url, "grpc", args.model, timeout=30)
    server = None
    if not server_answers(client):
        print(f"no server at {args.url}: starting tritonserver on model_repository", flush=True)
        ports = (args.http_port, int(args.url.rpartition(":")[2]), args.metrics_port)
        server = TritonServer(MODEL_REPOSITORY, args.output_dir / "tritonserver.log", ports=ports, address=None)
    try:
        if server is not None:
            server.wait_ready()
        exports, failure = sweep(args)
        print(f"\n{args.input_data.name}, gRPC streaming, model {args.model} at {args.url}; "
              f"exports in {args.output_dir}")
        if exports:
            print(format_table(load_summaries([str(path) for path in exports])), flush=True)
    finally:
        if server is not None:
            server.stop()
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
