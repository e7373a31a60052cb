"""Time to the first response of a long prompt, per attention backend, in process, against the forward's compute
floor, in one run.

For each backend in --backends and each batch in --batches: a random-weight model of the --model shape (built on the
device once, shared by every engine), `batch` requests of a --prompt-token random prompt, added together, each
asking for one 32-token block decoded in one step (top-k, steps 1), so that the first step's forward (the prompts
with their first blocks, as multi_bd feeds them) ends with every request's first response. It reports:
  - ttft_ms: the wall time from adding the requests to that step's end, the median over --repeats rounds of fresh
    prompts after one warm-up round;
  - the forward's compute floor: 2 x the layers' parameters per token (the routed experts' active ones), 2 x the output head's per block row, and
    attention's 4 x heads x head_dim per (query, key) pair each layer, counting the pairs the mask lets each query
    see, over the bf16 matmul rate measured in the run;
  - the attention's part of that floor, and ttft over the floor.
A backend the machine cannot run (flash_attn without the package, or on a CPU) gets a row saying why.

With --served, each backend is then served too: a random checkpoint of the same shape (other weights: these rows
time, they do not compare tokens) goes into a model repository built from the shipped config.pbtxt and model.py,
with the in-process engine's settings and that attention_backend, and tritonserver serves it. Each round sends
`batch` concurrent streaming requests (HTTP generate_stream, token ids) and takes the time from sending them to the
last one's first streamed response; the median over --repeats rounds after a warm-up, and its ratio to the in-process
figure of the same backend and batch. Writes prefill.csv and prefill.md to --out.

    python benchmarks/prefill.py --out DIR                     # GPU: LLaDA-8B, a 4096-token prompt, batches 1 and 8
    python benchmarks/prefill.py --out DIR --served            # and through tritonserver (tools/pack_gpu_runtime.py
                                                               # brings one to a GPU machine)
    python benchmarks/prefill.py --smoke --out DIR             # anywhere: a tiny model
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from diffulex_backend import SamplingParams  # noqa: E402
from diffulex_backend.testing.checkpoint import random_model, write_random_checkpoint  # noqa: E402
from forward import (BLOCK, PAGE_SIZE, long_prompt_arguments, long_prompt_setup, make_engine,  # noqa: E402
                     measure_ceilings, write_model_dir)
from result_table import ResultTable  # noqa: E402

REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = ["model", "backend", "mode", "batch", "prompt", "ttft_ms", "compute_floor_ms", "attention_floor_ms",
          "ttft_vs_floor", "ttft_vs_first_backend", "served_vs_in_process", "note"]


def first_step_flops(model, masks: list[np.ndarray]) -> tuple[float, float]:
    """(all, attention's) flops of the first forward, from each request's block ids over its prompt and first
    block (attention.py's mask: a query sees the keys whose block id is at most its own). Every token goes through
    the layers' products (the embedding is a lookup); only the block's rows through the output head."""
    arch = model.arch
    head = arch.vocab_size * arch.hidden_size
    # A mixture of experts multiplies a token by the experts it is routed to only.
    layers = arch.num_active_params() - head * (1 if arch.tie_word_embeddings else 2)
    per_pair = 4.0 * arch.num_layers * arch.num_heads * arch.head_dim
    pairs = sum(int(np.searchsorted(ids, ids, side="right").sum()) for ids in masks)  # block ids never decrease
    tokens = sum(len(ids) for ids in masks)
    attention = per_pair * pairs
    return 2.0 * layers * tokens + 2.0 * head * BLOCK * len(masks) + attention, attention


def run(engine, batch: int, prompt: int, repeats: int, generator: torch.Generator):
    params = SamplingParams(max_tokens=BLOCK, steps=1, ignore_eos=True)
    times, masks = [], []
    for _ in range(1 + repeats):  # a warm-up round first
        prompts = [torch.randint(0, 256, (prompt,), generator=generator).tolist() for _ in range(batch)]
        start = time.perf_counter()
        ids = [engine.add_request(tokens, params) for tokens in prompts]
        adding = time.perf_counter() - start
        masks = [engine.requests[i].block_ids(np.arange(prompt + BLOCK)) for i in ids]  # untimed
        start = time.perf_counter()
        outputs = engine.step()
        times.append(adding + time.perf_counter() - start)
        answered = {out.request_id for out in outputs if out.token_ids}
        if answered != set(ids):
            raise RuntimeError(f"{len(answered)} of {batch} requests answered in the first step")
        while engine.has_unfinished_requests():
            engine.step()
    return 1e3 * statistics.median(times[1:]), masks


def engine_settings(batch: int, prompt: int, **kwargs) -> dict:
    """What every engine here takes beside the model: one request per batch row, its prompt and two blocks."""
    return dict(sampling_mode="topk", max_model_len=prompt + 2 * BLOCK, max_num_reqs=batch,
                max_num_batched_tokens=batch * (prompt + BLOCK),
                num_kv_pages=batch * -(-(prompt + 2 * BLOCK) // PAGE_SIZE) + 8, **kwargs)


def first_response(url: str, prompt: list[int], start: float) -> float:
    """Seconds from `start` to one streamed request's first response; the stream is read to its end."""
    body = {"input_ids": prompt, "parameters": {"max_tokens": BLOCK, "steps": 1, "ignore_eos": True, "temperature": 0}}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    first = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: "):
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise RuntimeError(f"generate_stream answered an error: {event['error']}")
                first = first or time.perf_counter() - start
    if first is None:
        raise RuntimeError("generate_stream ended without a response")
    return first


def served_ttft(url: str, batch: int, prompt: int, repeats: int, generator: torch.Generator) -> float:
    """ms from sending `batch` concurrent requests to the last one's first response, the median over the rounds
    after a warm-up."""
    times = []
    with ThreadPoolExecutor(max_workers=batch) as pool:
        for _ in range(1 + repeats):
            prompts = [torch.randint(0, 256, (prompt,), generator=generator).tolist() for _ in range(batch)]
            start = time.perf_counter()
            times.append(max(pool.map(lambda tokens: first_response(url, tokens, start), prompts)))
    return 1e3 * statistics.median(times[1:])


def serve(checkpoint: str, backend: str, batches: list[int], prompt: int, device: torch.device, dtype: torch.dtype,
          tmp: pathlib.Path):
    """A tritonserver serving the checkpoint with this attention backend, ready; the caller stops it."""
    sys.path.insert(0, str(REPOSITORY_ROOT / "tests"))
    from triton_server import TritonServer, add_model

    repository = tmp / f"repository-{backend}"
    add_model(repository, "diffulex", model=checkpoint, attention_backend=backend, block_size=BLOCK,
              page_size=PAGE_SIZE, enable_prefix_caching="false", device=str(device), dtype=str(dtype).split(".")[1],
              **engine_settings(max(batches), prompt))
    server = TritonServer(repository, tmp / f"tritonserver-{backend}.log")
    try:
        server.wait_ready(1800)
    except BaseException:
        server.stop(60)
        raise
    return server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    long_prompt_arguments(parser)
    parser.add_argument("--backends", default="triton,flash_attn", help="attention_backend values; the first is "
                        "the baseline")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a 64-token prompt")
    parser.add_argument("--served", action="store_true", help="each backend through tritonserver too")
    args = parser.parse_args(argv)
    prompt, repeats = (64, 1) if args.smoke else (args.prompt, args.repeats)
    device, plan, shape, name, dtype = long_prompt_setup(args.model, args.smoke, prompt)
    matmul_rate = measure_ceilings(device, plan).matmul_rate
    model = random_model(**shape, dtype=dtype, device=device, seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("prefill", FIELDS)
    generator = torch.Generator().manual_seed(3)
    batches = [int(b) for b in args.batches.split(",")]
    in_process = {}  # (backend, batch) -> ms, where the backend ran
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(shape, pathlib.Path(tmp) / name)
        for batch in batches:
            baseline = None
            for backend in args.backends.split(","):
                row = dict(model=name, backend=backend, mode="in process", batch=batch, prompt=prompt)
                try:
                    engine = make_engine(model, model_dir, device, plan, attention_backend=backend,
                                         **engine_settings(batch, prompt))
                except ValueError as refused:  # the backend cannot run here: the row says why
                    table.add(**{**dict.fromkeys(FIELDS, ""), **row, "note": str(refused)})
                    continue
                ttft_ms, masks = run(engine, batch, prompt, repeats, generator)
                flops, attention_flops = first_step_flops(model, masks)
                floor_ms = 1e3 * flops / matmul_rate
                baseline = baseline or ttft_ms
                in_process[backend, batch] = ttft_ms
                table.add(**row, ttft_ms=ttft_ms, compute_floor_ms=floor_ms,
                          attention_floor_ms=1e3 * attention_flops / matmul_rate, ttft_vs_floor=ttft_ms / floor_ms,
                          ttft_vs_first_backend=ttft_ms / baseline, served_vs_in_process="",
                          note=f"{device}, {dtype}, {engine.resolved_settings()['attention_backend']} attention")
                del engine
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                table.write(args.out, argv)  # after every row: a run cut off keeps what it measured
        if args.served:
            del model  # the server's engine loads its own
            if device.type == "cuda":
                torch.cuda.empty_cache()
            family_shape = dict(shape)
            checkpoint = str(write_random_checkpoint(pathlib.Path(tmp) / "served", family_shape.pop("model_name"),
                                                     dtype=dtype, num_shards=None, device=device,
                                                     **family_shape))
            for backend in args.backends.split(","):
                ran = [batch for batch in batches if (backend, batch) in in_process]
                if not ran:
                    continue  # refused in process: its rows say why
                server = serve(checkpoint, backend, ran, prompt, device, dtype, pathlib.Path(tmp))
                try:
                    url = f"{server.http_url}/v2/models/diffulex/generate_stream"
                    for batch in ran:
                        ttft_ms = served_ttft(url, batch, prompt, repeats, generator)
                        table.add(**{**dict.fromkeys(FIELDS, ""), **dict(
                            model=name, backend=backend, mode="served", batch=batch, prompt=prompt, ttft_ms=ttft_ms,
                            served_vs_in_process=ttft_ms / in_process[backend, batch],
                            note=f"{device}, {dtype}, HTTP generate_stream, {batch} concurrent requests")})
                        table.write(args.out, argv)
                finally:
                    server.stop(120)
    table.write(args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
