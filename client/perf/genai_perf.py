"""Run NVIDIA's genai-perf against the diffulex model, as each of its Triton request shapes sends them.

    python -m diffulex_client.perf.genai_perf --grpc-url localhost:8001 --http-url localhost:8000
        --openai-url localhost:9000 --tokenizer model_repository/diffulex/demo-llada
        [--modes vllm tensorrtllm generate completions chat] [--concurrency 4] [--output-dir build/genai-perf]

Modes:
  vllm         `--endpoint-type kserve --backend vllm`: gRPC streaming, `sampling_parameters` with string values
  tensorrtllm  `--endpoint-type kserve --backend tensorrtllm`: gRPC streaming, TensorRT-LLM's tensor inputs
  generate     `--endpoint-type generate`: HTTP on Triton's generate endpoint
  completions  `--endpoint-type completions`: the OpenAI front's /v1/completions, streamed
  chat         `--endpoint-type chat`: the OpenAI front's /v1/chat/completions, streamed (the model needs a template)

The OpenAI modes send `ignore_eos` as a body field (genai-perf fixes the output length only on Triton's endpoints),
so that every request generates `--output-tokens` tokens; `--input-file` gives prompts of one's own (genai-perf's
JSONL, one `{"text": ...}` a line) instead of synthetic ones.

genai-perf lives in a virtual environment of its own (`make genai-perf-setup` builds `.venv-genai-perf`): it
installs a placeholder `perf-analyzer` package and pins other libraries. It drives the `perf_analyzer` binary of
tritonclient 2.51, which this environment has; that binary hangs on genai-perf's `--request-count`, so runs are
measured over time windows (`--measurement-interval`). `--tokenizer` must be a local directory: genai-perf would
otherwise look for the tokenizer on a model hub.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from diffulex_client.perf.sweep import EXPORT_ATTEMPTS, export_is_whole, perf_analyzer_env, perf_analyzer_path

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
GENAI_PERF = REPOSITORY_ROOT / ".venv-genai-perf" / "bin" / "genai-perf"
MODES = {
    "vllm": ["--endpoint-type", "kserve", "--backend", "vllm", "--streaming"],
    "tensorrtllm": ["--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming"],
    "generate": ["--endpoint-type", "generate"],
    "completions": ["--endpoint-type", "completions", "--streaming", "--extra-inputs", "ignore_eos:true"],
    "chat": ["--endpoint-type", "chat", "--streaming", "--extra-inputs", "ignore_eos:true"],
}
OPENAI_MODES = ("completions", "chat")


@dataclass(frozen=True)
class GenaiPerfResult:
    mode: str
    returncode: int
    output: str
    metrics: dict[str, float]  # the summary CSV's single-value rows, e.g. "Request Count (count)"
    output_tokens_avg: float | None  # "Output Sequence Length (tokens)" average, when genai-perf reports it


def genai_perf_command(mode: str, *, grpc_url: str, http_url: str, model: str, tokenizer: Path, concurrency: int,
                       measurement_interval_ms: int, input_tokens: int, output_tokens: int, artifact_dir: Path,
                       openai_url: str = "localhost:9000", api_key: str | None = None,
                       input_file: Path | None = None) -> list[str]:
    url = {"generate": http_url, **dict.fromkeys(OPENAI_MODES, openai_url)}.get(mode, grpc_url)
    inputs = (["--input-file", str(input_file)] if input_file is not None else
              ["--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0"])
    return [str(GENAI_PERF), "profile", "-m", model, "-u", url, *MODES[mode], "--tokenizer", str(tokenizer),
            *inputs, "--output-tokens-mean", str(output_tokens),
            # A fixed output length (min_tokens / min_length) is sent only on the kserve endpoint.
            *(["--output-tokens-mean-deterministic"] if mode in ("vllm", "tensorrtllm") else []),
            *(["--header", f"Authorization:Bearer {api_key}"] if api_key and mode in OPENAI_MODES else []),
            "--concurrency", str(concurrency), "--measurement-interval", str(measurement_interval_ms),
            "--artifact-dir", str(artifact_dir)]


def genai_perf_env() -> dict[str, str]:
    """tritonclient's perf_analyzer first on PATH, with libcudart on the library path."""
    env = perf_analyzer_env()
    env["PATH"] = str(Path(perf_analyzer_path()).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_genai_perf(mode: str, artifact_dir: Path, **options) -> GenaiPerfResult:
    if not GENAI_PERF.is_file():
        raise SystemExit(f"{GENAI_PERF} is missing: run `make genai-perf-setup`")
    command = genai_perf_command(mode, artifact_dir=artifact_dir, **options)
    for _ in range(EXPORT_ATTEMPTS):
        done = subprocess.run(command, capture_output=True, text=True, env=genai_perf_env(), timeout=600)
        # perf_analyzer 2.51 can exit 0 leaving an empty or cut export, on which genai-perf then fails
        # (sweep.export_is_whole says why): such a run is made again, without the broken export, which perf_analyzer
        # would refuse to overwrite; a failure with a whole export, or none, is not.
        broken = [path for path in artifact_dir.glob("**/profile_export.json") if not export_is_whole(path)]
        if done.returncode == 0 or not broken:
            break
        for path in broken:
            path.unlink()
    metrics, output_tokens = {}, None
    for path in artifact_dir.glob("*/profile_export_genai_perf.csv"):
        for row in csv.reader(path.read_text().splitlines()):
            if len(row) == 2 and row[0] != "Metric":
                metrics[row[0]] = float(row[1].replace(",", ""))
            elif row and row[0] == "Output Sequence Length (tokens)" and row[1] != "N/A":
                output_tokens = float(row[1])
    return GenaiPerfResult(mode, done.returncode, done.stdout + done.stderr, metrics, output_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffulex_client.perf.genai_perf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", default="localhost:8001")
    parser.add_argument("--http-url", default="localhost:8000")
    parser.add_argument("--openai-url", default="localhost:9000", help="the OpenAI front, for completions and chat")
    parser.add_argument("--api-key", help="the OpenAI front's --api-key, when it has one")
    parser.add_argument("--input-file", type=Path, help="genai-perf JSONL prompts instead of synthetic ones")
    parser.add_argument("--model", default="diffulex")
    parser.add_argument("--tokenizer", type=Path, default=REPOSITORY_ROOT / "model_repository/diffulex/demo-llada")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES),
                        default=[mode for mode in MODES if mode not in OPENAI_MODES])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--measurement-interval-ms", type=int, default=5000)
    parser.add_argument("--input-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--output-dir", type=Path, default=Path("build/genai-perf"))
    args = parser.parse_args(argv)
    failed = False
    for mode in args.modes:
        result = run_genai_perf(mode, args.output_dir / mode, grpc_url=args.grpc_url, http_url=args.http_url,
                                openai_url=args.openai_url, api_key=args.api_key, input_file=args.input_file,
                                model=args.model, tokenizer=args.tokenizer, concurrency=args.concurrency,
                                measurement_interval_ms=args.measurement_interval_ms, input_tokens=args.input_tokens,
                                output_tokens=args.output_tokens)
        print(f"== {mode}: exit {result.returncode}; " + ", ".join(f"{k} {v:g}" for k, v in result.metrics.items()))
        if result.returncode:
            print(result.output[-4000:], file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
