"""Data parallelism through tritonserver, in one run: one model instance against one per GPU, under the same
perf_analyzer load.

One checkpoint (a random LLaDA-8B by default, drawn on the GPU) serves the shipped config.pbtxt twice: first with one
KIND_GPU instance on GPU 0, then with one instance on each of --gpus GPUs (an engine each: Triton hands each batch of
waiting requests to an idle instance). Each server takes perf_analyzer over gRPC streaming at --concurrency, in count
windows, with --input-data's prompts (greedy, max_tokens as they say), and the table gives requests/s and output
tokens/s from perf_analyzer's export, and the throughput ratio of N instances over one. Writes data_parallel.csv and
data_parallel.md to --out.

    python benchmarks/data_parallel.py --out DIR                     # two GPUs: LLaDA-8B, concurrency 64
    python benchmarks/data_parallel.py --out DIR --checkpoint CKPT   # an existing checkpoint
    python benchmarks/data_parallel.py --out DIR --smoke             # anywhere: a tiny model, two KIND_CPU instances

On a GPU machine without tritonserver, tools/pack_gpu_runtime.py brings one; run this with its python.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the model repository builder the tests use

from diffulex_client.perf.report import load_summaries  # noqa: E402
from diffulex_client.perf.sweep import run_perf_analyzer  # noqa: E402
from diffulex_backend.serving.triton_adapter import KERNEL_CACHE_DIR  # noqa: E402
from result_table import ResultTable  # noqa: E402
from serving import write_checkpoint  # noqa: E402
from triton_server import TritonServer, add_model  # noqa: E402

MODEL = "diffulex"
FIELDS = ["instances", "kind", "concurrency", "requests", "requests_per_s", "output_tokens_per_s", "speedup",
          "ideal_speedup", "latency_p50_ms", "note"]
# The tiny model's engine settings (blocks of 4 tokens) and the KV pages each engine holds: two CPU instances share
# the host, so neither sizes itself from what is free.
SMOKE_SETTINGS = dict(block_size=4, page_size=4, max_model_len=128, max_num_reqs=4, num_kv_pages=256)


def instance_group(instances: int, smoke: bool) -> str:
    if smoke:
        return f"[{{ kind: KIND_CPU, count: {instances} }}]"
    return f"[{{ kind: KIND_GPU, count: 1, gpus: [{', '.join(map(str, range(instances)))}] }}]"


def measure(repository: Path, instances: int, args, log_dir: Path) -> dict:
    """Serve the repository with `instances` instances and load it with perf_analyzer; the export's summary."""
    server = TritonServer(repository, log_dir / f"tritonserver_{instances}.log")
    try:
        started = time.perf_counter()
        server.wait_ready(args.startup_timeout_s)
        print(f"{instances} instance(s): ready in {time.perf_counter() - started:.1f} s", flush=True)
        export = log_dir / f"profile_{instances}.json"
        result = run_perf_analyzer(server.grpc_url, MODEL, args.input_data, args.concurrency,
                                   max(args.requests_per_window, 4 * args.concurrency), export,
                                   args.stability_percentage, args.max_trials)
        (log_dir / f"perf_analyzer_{instances}.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise SystemExit(f"perf_analyzer failed with {instances} instance(s) (exit {result.returncode}):\n"
                             f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
        (summary,) = load_summaries([str(export)])
        return summary
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, help="an existing checkpoint instead of a random LLaDA-8B")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, two KIND_CPU instances")
    parser.add_argument("--gpus", type=int, default=2, help="instances of the data-parallel run, one per GPU")
    parser.add_argument("--concurrency", type=int, default=None, help="default: 64, or 4 with --smoke")
    parser.add_argument("--input-data", type=Path, default=REPO / "client" / "perf" / "medium_streaming.json")
    parser.add_argument("--requests-per-window", type=int, default=128)
    parser.add_argument("--stability-percentage", type=float, default=10)
    parser.add_argument("--max-trials", type=int, default=10)
    parser.add_argument("--startup-timeout-s", type=float, default=900)
    args = parser.parse_args(argv)
    if args.smoke:
        args.input_data = REPO / "client" / "perf" / "short_streaming.json"
        args.concurrency = args.concurrency or 4
        args.requests_per_window, args.stability_percentage = 8, 100
    args.concurrency = args.concurrency or 64
    if not args.smoke and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    os.environ.setdefault("TRITON_CACHE_DIR", str(KERNEL_CACHE_DIR))  # every instance compiles into one cache
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("data_parallel", FIELDS)
    work = Path(tempfile.mkdtemp(prefix="diffulex-data-parallel-"))
    try:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        checkpoint = args.checkpoint or write_checkpoint(work / "checkpoint", "tiny" if args.smoke else "llada-8b",
                                                         device)
        settings = SMOKE_SETTINGS if args.smoke else {}
        baseline = None
        for instances in (1, args.gpus):
            repository = work / f"repository_{instances}"
            repository.mkdir()
            add_model(repository, MODEL, model=Path(checkpoint).resolve(),
                      instance_group=instance_group(instances, args.smoke), **settings)
            summary = measure(repository, instances, args, args.out)
            baseline = baseline or summary
            table.add(instances=instances, kind="KIND_CPU" if args.smoke else "KIND_GPU",
                      concurrency=args.concurrency, requests=summary.num_requests,
                      requests_per_s=summary.requests_per_s, output_tokens_per_s=summary.output_tokens_per_s,
                      speedup=summary.output_tokens_per_s / baseline.output_tokens_per_s,
                      ideal_speedup=float(instances), latency_p50_ms=summary.latency_p50_ms,
                      note=f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
                           f"{args.input_data.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table.write(args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
