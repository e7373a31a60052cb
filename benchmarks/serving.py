"""The same requests in process and through tritonserver, measured in one run: what serving costs.

One run, on one machine, over one checkpoint (a random LLaDA-8B by default, written first) and one set of settings
(the shipped model_repository/diffulex/config.pbtxt with `model` pointed at the checkpoint):

  1. in process: `Diffulex(...)` built from the settings the served model reads, warmed up as the served model
     warms itself (warm_up), then for each batch size B: one warm-up `generate` of B other prompts, then
     `generate` of the B prompts, timed by the wall clock (--repeats rounds, each on fresh prompts);
  2. in process, through the served model's engine loop (EngineLoop: a decoding thread and a response thread,
     request parsing and response building) but with no server: the streams and metrics are counters. This is the
     cost of the threads and the response side without the stub's round trips to the server;
  3. served: the engine is freed, tritonserver starts on a model repository built in a temporary folder from the
     shipped config.pbtxt and model.py, and the same prompts go as B concurrent HTTP `generate` requests (token ids,
     max_tokens, temperature 0, ignore_eos), after one warm-up round of B requests;
  4. with --front, through the OpenAI front (client/openai_front, its own process, over gRPC to the same server):
     B concurrent `/v1/completions` requests of token-id prompts with the same settings. Its prompts are its own
     (with in-process references), so that the prefix cache the served rounds filled gives it no head start; its
     texts are checked against the decoded in-process tokens.

Every round checks that each request's output_ids equal the in-process ones. With --py-spy, one more served round at
the largest batch runs under py-spy (all threads, then only the thread holding the GIL) and the stacks are summed
by thread and by what the thread was doing.

Ratio = served / in process, per batch size, from the median round. It writes serving.csv, serving.md and, with
py-spy, profile.md and the raw stacks to --out.

    python benchmarks/serving.py --out DIR                        # GPU: random LLaDA-8B, batches 1 and 32
    python benchmarks/serving.py --out DIR --checkpoint CKPT      # an existing checkpoint
    python benchmarks/serving.py --out DIR --smoke                # anywhere: a tiny model, batches 1 and 2
    python benchmarks/serving.py --out DIR --front                # also through the OpenAI front (needs fastapi,
                                                                  # uvicorn and tritonclient in this python)

On a GPU machine without tritonserver, tools/pack_gpu_runtime.py brings one; run this with its python.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gc
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY_ROOT / "tests"))

from triton_server import TritonServer, add_model

from diffulex_client.perf.front_process import FrontProcess

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.serving.engine_loop import EngineLoop
from diffulex_backend.serving.engine_settings import engine_settings
from diffulex_backend.serving.metrics import ServingMetrics
from diffulex_backend.serving.request_parsing import parse_request
from diffulex_backend.serving.response_building import ResponseAssembler
from diffulex_backend.serving.triton_adapter import KERNEL_CACHE_DIR
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, RELEASED_SHAPES, write_random_checkpoint
from diffulex_backend.tokenizer import load_tokenizer

MODEL = "diffulex"
FIELDS = ["mode", "batch", "round", "seconds", "steps", "ms_per_step", "output_tokens", "tokens_per_s", "outputs_equal",
          "prefix_hit_tokens", "note"]


@dataclass(frozen=True)
class Plan:
    shape: str  # a RELEASED_SHAPES key, or "tiny" (write_random_checkpoint's defaults)
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    repeats: int
    overrides: dict = field(default_factory=dict)  # config.pbtxt parameters besides `model`
    startup_timeout_s: float = 540.0


FULL = Plan(shape="llada-8b", batches=(1, 32), prompt_len=256, new_tokens=256, repeats=3)
# Small blocks so that a few new tokens still span several blocks, and responses several steps.
SMOKE = Plan(shape="tiny", batches=(1, 2), prompt_len=16, new_tokens=16, repeats=1,
             overrides=dict(block_size=4, page_size=4, max_model_len=64, max_num_reqs=4), startup_timeout_s=300.0)


# ---- checkpoint, settings, prompts --------------------------------------------------------------------------
def write_checkpoint(directory: Path, shape: str, device: torch.device) -> Path:
    """A random-weight LLaDA checkpoint in bf16, its weights drawn on `device` (an 8B model drawn on the CPU takes
    minutes)."""
    if shape == "tiny":
        return write_random_checkpoint(directory, "llada")
    arguments = dict(RELEASED_SHAPES[shape])
    model_name = arguments.pop("model_name")
    written = write_random_checkpoint(directory, model_name, dtype=torch.bfloat16, num_shards=4, device=device,
                                      **arguments)
    free_memory()
    return written


PARAMETER = re.compile(r'\{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}')


def served_settings(config_path: Path) -> dict:
    """The engine settings the served model reads from this config.pbtxt, as the adapter reads them."""
    parameters = {key: {"string_value": value} for key, value in PARAMETER.findall(config_path.read_text())}
    return engine_settings(parameters, model_dir=config_path.parent)


def make_prompts(plan: Plan, seed: int) -> dict[tuple[int, str], list[list[int]]]:
    """Byte-token prompts (never the mask token), per (batch, round name); the same set serves every mode."""
    generator = torch.Generator().manual_seed(seed)
    prompts = {}
    for batch in plan.batches:
        for name in ["warm-up"] + [str(i) for i in range(plan.repeats)] + ["profile", "staggered"] + front_names(plan):
            ids = torch.randint(0, 256, (batch, plan.prompt_len), generator=generator)
            assert not (ids == MASK_TOKEN_ID).any()
            prompts[batch, name] = ids.tolist()
    return prompts


def front_names(plan: Plan) -> list[str]:
    """The front's own rounds: its prompts differ from the served rounds', whose prefixes the server has cached."""
    return ["front-warm-up"] + [f"front-{i}" for i in range(plan.repeats)]


def request_parameters(plan: Plan) -> dict:
    return {"max_tokens": plan.new_tokens, "temperature": 0, "ignore_eos": True}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- results -------------------------------------------------------------------------------------------------
@dataclass
class Round:
    mode: str
    batch: int
    name: str
    seconds: float
    steps: int  # forward passes: the engine's counter in process, the largest per-request nfe when served
    output_ids: list[list[int]]
    outputs_equal: bool | None = None
    prefix_hit_tokens: int | None = None
    note: str = ""
    counts: dict = field(default_factory=dict)
    tokens: int | None = None  # counted by the server, where the ids do not come back (the OpenAI front)

    @property
    def output_tokens(self) -> int:
        return self.tokens if self.tokens is not None else sum(len(ids) for ids in self.output_ids)


class Report:
    def __init__(self, out: Path):
        self.out = out
        self.rounds: list[Round] = []
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "serving.csv", "w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()

    def add(self, r: Round) -> None:
        self.rounds.append(r)
        row = dict(mode=r.mode, batch=r.batch, round=r.name, seconds=f"{r.seconds:.4f}", steps=r.steps,
                   ms_per_step=f"{1e3 * r.seconds / r.steps:.3f}" if r.steps and r.seconds else "", output_tokens=r.output_tokens,
                   tokens_per_s=f"{r.output_tokens / r.seconds:.1f}" if r.seconds else "",
                   outputs_equal="" if r.outputs_equal is None else r.outputs_equal,
                   prefix_hit_tokens="" if r.prefix_hit_tokens is None else r.prefix_hit_tokens, note=r.note)
        with open(self.out / "serving.csv", "a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)

    def timed(self, mode: str, batch: int) -> list[Round]:
        return [r for r in self.rounds if r.mode == mode and r.batch == batch and r.name.isdigit()]


def median_round(rounds: list[Round]) -> Round | None:
    return sorted(rounds, key=lambda r: r.seconds)[(len(rounds) - 1) // 2] if rounds else None


# ---- 1. in process: generate ----------------------------------------------------------------------------------
def run_generate(engine, plan: Plan, prompts, report: Report, reference: dict, front: bool = False) -> None:
    params = SamplingParams(**request_parameters(plan))
    for batch in plan.batches:
        names = ["warm-up"] + [str(i) for i in range(plan.repeats)]
        if batch == max(plan.batches) > 1:
            names.append("staggered")  # the reference of the staggered-admission check; not a timing
        if front:
            names += front_names(plan)  # the references of the front's rounds; not timings
        for name in names:
            before, hits = engine.metrics().num_forward_passes, engine.metrics().prefix_cache_hit_tokens
            synchronize()
            start = time.perf_counter()
            outputs = engine.generate(prompts[batch, name], params)
            synchronize()
            seconds = time.perf_counter() - start
            output_ids = [list(out.token_ids) for out in outputs]
            reference[batch, name] = output_ids
            report.add(Round("in-process", batch, name, seconds, engine.metrics().num_forward_passes - before,
                             output_ids, prefix_hit_tokens=engine.metrics().prefix_cache_hit_tokens - hits,
                             note="reference for the staggered check" if name == "staggered" else
                             "reference for the front" if name.startswith("front-") else ""))


def run_staggered(engine, plan: Plan, prompts, report: Report, reference: dict) -> None:
    """Exactness under a different batch composition, in process: the first request alone for one step, then the
    others, as requests that arrive over HTTP a little apart join the running batch. Against `generate` of the same
    prompts all at once (on another engine, so that neither saw them before)."""
    batch = max(plan.batches)
    if batch == 1:
        return
    params = SamplingParams(**request_parameters(plan))
    first, *rest = prompts[batch, "staggered"]
    ids = [engine.add_request(first, params)]
    got: dict[str, list[int]] = collections.defaultdict(list)
    for output in engine.step():
        got[output.request_id] += output.token_ids
    ids += [engine.add_request(prompt, params) for prompt in rest]
    steps = 1
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] += output.token_ids
        steps += 1
    output_ids = [got[request_id] for request_id in ids]
    equal = output_ids == reference[batch, "staggered"]
    report.add(Round("in-process-staggered", batch, "staggered", 0.0, steps, output_ids, outputs_equal=equal,
                     note="first request one step ahead of the others; not a timing" +
                          ("" if equal else "; " + first_difference(output_ids, reference[batch, "staggered"]))))


# ---- 2. in process: the served engine loop, with counters for Triton ------------------------------------------
class CountingMetric:
    def __init__(self, counts: collections.Counter):
        self._counts = counts

    def increment(self, value) -> None:
        self._counts["metric.increment"] += 1

    def set(self, value) -> None:
        self._counts["metric.set"] += 1

    def observe(self, value) -> None:
        self._counts["metric.observe"] += 1


def counting_metric_family(counts: collections.Counter):
    """Stands in for pb_utils.MetricFamily: every call that would be a round trip to the server is counted."""

    class CountingMetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            pass

        def Metric(self, labels, buckets=None):
            return CountingMetric(counts)

    return CountingMetricFamily


class CountingStream:
    """Stands in for a Triton response sender: builds the response arrays as the adapter does, counts the calls
    that would be round trips, and records the final output's ids."""

    def __init__(self, assembler: ResponseAssembler, counts: collections.Counter, done: threading.Event):
        self._assembler, self._counts, self._done = assembler, counts, done
        self.output_ids: list[int] | None = None
        self.error = ""

    def is_cancelled(self) -> bool:
        self._counts["sender.is_cancelled"] += 1
        return False

    def send_output(self, output) -> None:
        arrays = self._assembler.add(output)
        if arrays is not None:
            self._counts["sender.send"] += 1
            if output.finished:
                self.output_ids = arrays["output_ids"].reshape(-1).tolist()
        if output.finished:
            self._done.set()

    def send_error(self, kind, message: str) -> None:
        self.error = f"{kind.name}: {message}"
        self._done.set()


def run_engine_loop(engine, plan: Plan, prompts, report: Report, reference: dict) -> None:
    counts: collections.Counter = collections.Counter()
    metrics = ServingMetrics(counting_metric_family(counts), {"model": MODEL, "version": "1"})
    scheduled: list[int] = []  # requests in each forward, read by the decoding thread after its step
    step = engine.step

    def counted_step():
        outputs = step()
        scheduled.append(len(engine.last_schedule.plans))
        return outputs

    engine.step = counted_step
    loop = EngineLoop(engine, metrics)
    parameters = json.dumps(request_parameters(plan))
    try:
        for batch in plan.batches:
            for name in ["warm-up"] + [str(i) for i in range(plan.repeats)]:
                counts.clear()
                scheduled.clear()
                before = engine.metrics().num_forward_passes  # read while the loop is idle
                hits = engine.metrics().prefix_cache_hit_tokens
                streams, events = [], []
                start = time.perf_counter()
                for prompt in prompts[batch, name]:  # as TritonAdapter.execute does for each request
                    parsed = parse_request({"input_ids": np.array([prompt], dtype=np.int64)}, parameters)
                    prepared = engine.prepare_request(parsed.prompt, parsed.params)
                    events.append(threading.Event())
                    text = lambda prompt=parsed.prompt: engine.tokenizer.decode(prompt)
                    streams.append(CountingStream(ResponseAssembler(parsed, text), counts, events[-1]))
                    loop.submit(prepared, streams[-1])
                for event in events:
                    if not event.wait(600):
                        raise RuntimeError("the engine loop did not finish a request within 600 s")
                seconds = time.perf_counter() - start
                time.sleep(0.05)  # let the decoding thread go idle before its counters are read
                errors = [s.error for s in streams if s.error]
                if errors:
                    raise RuntimeError(f"the engine loop answered with an error: {errors[0]}")
                output_ids = [s.output_ids for s in streams]
                steps = engine.metrics().num_forward_passes - before
                per_step = {k: round(v / max(steps, 1), 2) for k, v in sorted(counts.items())}
                equal = output_ids == reference[batch, name]
                partial = sum(1 for n in scheduled if n < batch)
                report.add(Round("engine-loop", batch, name, seconds, steps, output_ids, outputs_equal=equal,
                                 prefix_hit_tokens=engine.metrics().prefix_cache_hit_tokens - hits,
                                 note=f"requests in the first forwards {scheduled[:4]}, {partial} of {len(scheduled)} "
                                      f"forwards with fewer than {batch}; Triton calls per step: {per_step}" +
                                      ("" if equal else "; " + first_difference(output_ids, reference[batch, name])),
                                 counts=dict(counts)))
    finally:
        loop.stop()
        del engine.step


# ---- 3. served -----------------------------------------------------------------------------------------------
def post_generate(url: str, prompt: list[int], parameters: dict) -> dict:
    body = {"input_ids": prompt, "return_nfe": True, "parameters": parameters}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"generate answered {err.code}: {err.read()[:2000]!r}") from None


def listify(value) -> list:  # the generate extension writes a one-element tensor as a scalar
    return value if isinstance(value, list) else [value]


def served_round(server: TritonServer, batch: int, prompts: list[list[int]], plan: Plan) -> tuple[float, list, list]:
    """Wall time of the B concurrent requests, their output_ids and their nfe (forward passes each took part in)."""
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    parameters = request_parameters(plan)
    with ThreadPoolExecutor(max_workers=batch) as pool:
        start = time.perf_counter()
        futures = [pool.submit(post_generate, url, prompt, parameters) for prompt in prompts]
        answers = [future.result() for future in futures]
        seconds = time.perf_counter() - start
    output_ids = [listify(answer["output_ids"]) for answer in answers]
    return seconds, output_ids, [max(listify(answer.get("nfe", 0))) for answer in answers]


def run_served(server: TritonServer, plan: Plan, prompts, report: Report, reference: dict) -> None:
    for batch in plan.batches:
        for name in ["warm-up"] + [str(i) for i in range(plan.repeats)]:
            seconds, output_ids, nfes = served_round(server, batch, prompts[batch, name], plan)
            steps = max(nfes)
            equal = output_ids == reference[batch, name]
            note = f"per-request nfe {min(nfes)}..{max(nfes)}"
            note += "" if equal else "; " + first_difference(output_ids, reference[batch, name])
            report.add(Round("served", batch, name, seconds, steps, output_ids, outputs_equal=equal, note=note))


# ---- 4. through the OpenAI front ------------------------------------------------------------------------------
def post_completion(url: str, prompt: list[int], plan: Plan) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": plan.new_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"the front answered {err.code}: {err.read()[:2000]!r}") from None


def front_round(front: FrontProcess, prompts: list[list[int]], plan: Plan) -> tuple[float, list[str], int]:
    """Wall time of the B concurrent completions, their texts and their generated tokens in all."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        start = time.perf_counter()
        futures = [pool.submit(post_completion, front.url, prompt, plan) for prompt in prompts]
        answers = [future.result() for future in futures]
        seconds = time.perf_counter() - start
    return seconds, [a["choices"][0]["text"] for a in answers], sum(a["usage"]["completion_tokens"] for a in answers)


def run_front(front: FrontProcess, tokenizer, plan: Plan, prompts, report: Report, reference: dict) -> None:
    for batch in plan.batches:
        for name in ["warm-up"] + [str(i) for i in range(plan.repeats)]:
            key = (batch, f"front-{name}")
            seconds, texts, tokens = front_round(front, prompts[key], plan)
            expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference[key]]
            equal = texts == expected and tokens == sum(len(ids) for ids in reference[key])
            note = "" if equal else f"texts or token counts differ from the in-process tokens ({tokens} tokens)"
            report.add(Round("front", batch, name, seconds, 0, [], outputs_equal=equal, note=note, tokens=tokens))


def first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"request {i} differs from token {at} of {len(b)} ({sum(x != y for x, y in zip(got, want))} differ)"
    return "different numbers of requests"


# ---- profiling the served model's stub with py-spy ------------------------------------------------------------
def stub_pid(server: TritonServer) -> int:
    """The Python backend stub that serves MODEL (a child of the server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat_fields[1]) == server.process.pid and "triton_python_backend_stub" in cmdline and MODEL in cmdline:
            found.append(int(entry.name))
    if len(found) != 1:
        raise RuntimeError(f"expected one stub process of {MODEL}, found {found}")
    return found[0]


def profile_served(server: TritonServer, py_spy: str, plan: Plan, prompts, report: Report, reference: dict,
                   out: Path) -> None:
    """One round at the largest batch under each recording: every thread (idle ones too), then the GIL holder."""
    batch = max(plan.batches)
    pid = stub_pid(server)
    summaries = []
    for label, flags in (("threads", ["--threads", "--idle"]), ("gil", ["--threads", "--gil"])):
        raw = out / f"py-spy-{label}.txt"
        recorder = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                     "--nonblocking", "--output", str(raw), *flags],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # py-spy attaches
        dumps: list[str] = []  # one snapshot of every thread's stack, a second into the round

        def dump() -> None:
            dumps.append(subprocess.run([py_spy, "dump", "--pid", str(pid), "--nonblocking"],
                                        capture_output=True, text=True).stdout)

        timer = threading.Timer(1.0, dump)
        if label == "threads":
            timer.start()
        seconds, output_ids, nfes = served_round(server, batch, prompts[batch, "profile"], plan)
        steps = max(nfes)
        if label == "threads":
            timer.join()
            (out / "py-spy-dump.txt").write_text("".join(dumps))
        recorder.send_signal(signal.SIGINT)
        try:
            log = recorder.communicate(timeout=60)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            recorder.kill()
            log = recorder.communicate()[0].decode(errors="replace")
        report.add(Round("served-py-spy", batch, f"profile-{label}", seconds, steps, output_ids,
                         note=f"under py-spy record {' '.join(flags)} (not a timing)"))
        if not raw.is_file():
            summaries.append(f"## py-spy {label}: no output\n\n```\n{log[-3000:]}\n```\n")
            continue
        summaries.append(summarize_stacks(raw, label, seconds, steps))
    (out / "profile.md").write_text(
        f"# Where the served model's stub spends its time (batch {batch}, {plan.new_tokens} new tokens)\n\n"
        "Stacks sampled at 200 Hz by py-spy from the stub process during one served round. `threads`: every thread, "
        "idle ones too (a thread's share of its own samples). `gil`: only the thread holding the GIL (a share of "
        "all GIL-holding samples).\n\n" + "\n".join(summaries))
    print((out / "profile.md").read_text(), flush=True)


# What a stack says its thread was doing: the first needle found among its frames, most specific first.
ACTIVITIES = [
    ("is_cancelled (", "cancellation poll (sender.is_cancelled)"),
    ("update_engine (", "metrics: gauge sets (update_engine)"),
    ("_observe (", "metrics: counters and histograms (_observe)"),
    ("ResponseAssembler.", "response: assembling arrays"),
    ("send_output (", "response: Tensor/InferenceResponse + sender.send"),
    ("send_error (", "response: error"),
    ("DiffulexEngine.metrics (", "engine.metrics() snapshot"),
    ("TritonPythonModel.execute (", "execute: parse, prepare, submit"),
]
WAITING_CALLS = (".get(", ".wait(", "sleep(", ".join(", ".acquire(")


def source_line(frame: str) -> str:
    """The source text of a frame written `function (path:line)`, for this checkout's files."""
    match = re.search(r"\(([^()]+):(\d+)\)$", frame)
    if not match:
        return ""
    path = REPOSITORY_ROOT / match.group(1)
    try:
        return path.read_text().splitlines()[int(match.group(2)) - 1]
    except (OSError, IndexError):
        return ""


def activity(frames: list[str]) -> str:
    for needle, name in ACTIVITIES:
        if any(needle in frame for frame in frames):
            return name
    for i, frame in enumerate(frames):
        if frame.startswith("DiffulexEngine.step ("):  # one level down: which part of the step
            inner = frames[i + 1].split(" (")[0] if i + 1 < len(frames) else "itself"
            if inner.startswith("context_decorator") and i + 2 < len(frames):
                inner = frames[i + 2].split(" (")[0]
            return f"engine.step > {inner}"
    leaf = frames[-1] if frames else "?"
    if any(call in source_line(leaf) for call in WAITING_CALLS):
        return f"idle: waiting in {leaf.split(' (')[0]}"
    return "other: " + leaf.split(" (")[0]


def split_stack(stack: str) -> tuple[str, list[str]]:
    """`thread (tid): name;frame;frame...` -> the thread's name and its frames, outermost first."""
    head, *frames = stack.split(";")
    name = head.split(": ", 1)[1] if ": " in head else head
    return name, frames


def summarize_stacks(raw: Path, label: str, seconds: float, steps: int) -> str:
    by_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        thread, frames = split_stack(stack)
        by_thread[thread][activity(frames) if frames else "idle (no Python frame)"] += int(count)
    total = sum(sum(c.values()) for c in by_thread.values())
    lines = [f"## py-spy {label}: {total} samples over a {seconds:.2f} s round of {steps} steps\n"]
    for thread in sorted(by_thread):
        counts = by_thread[thread]
        own = sum(counts.values())
        lines.append(f"\n**{thread}**: {own} samples ({100 * own / max(total, 1):.1f}% of all)\n")
        lines.append("| activity | samples | share of thread | ms per step (est.) |\n|---|---:|---:|---:|")
        rate_s = 1 / 200
        for name, n in counts.most_common(12):
            lines.append(f"| {name} | {n} | {100 * n / own:.1f}% | {1e3 * n * rate_s / max(steps, 1):.3f} |")
    return "\n".join(lines) + "\n"


# ---- the report -------------------------------------------------------------------------------------------------
def write_markdown(report: Report, plan: Plan, device: str, command: str, settings: dict) -> str:
    rows = ["| batch | in process (s) | engine loop, no server (s) | served (s) | served / in process | "
            "loop / in process | ms/step in process | ms/step served | steps in / served | served outputs equal |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for batch in plan.batches:
        inproc, loop, served = (median_round(report.timed(m, batch)) for m in ("in-process", "engine-loop", "served"))

        def s(r):
            return f"{r.seconds:.3f}" if r else "—"

        def ratio(r):
            return f"{r.seconds / inproc.seconds:.3f}x" if r and inproc else "—"

        def per_step(r):
            return f"{1e3 * r.seconds / r.steps:.2f}" if r and r.steps else "—"

        equal = [r.outputs_equal for r in report.timed("served", batch)]
        rows.append(f"| {batch} | {s(inproc)} | {s(loop)} | {s(served)} | {ratio(served)} | {ratio(loop)} | "
                    f"{per_step(inproc)} | {per_step(served)} | {inproc.steps if inproc else '—'} / "
                    f"{served.steps if served else '—'} | {all(equal) if equal else '—'} |")
    front_rows = ["| batch | served (s) | through the front (s) | front / served | front / in process | "
                  "front texts equal |", "|---:|---:|---:|---:|---:|---|"]
    for batch in plan.batches:
        inproc, served, front = (median_round(report.timed(m, batch)) for m in ("in-process", "served", "front"))
        if front is None:
            continue
        equal = [r.outputs_equal for r in report.timed("front", batch)]
        front_rows.append(f"| {batch} | {served.seconds:.3f} | {front.seconds:.3f} | "
                          f"{front.seconds / served.seconds:.3f}x | {front.seconds / inproc.seconds:.3f}x | "
                          f"{all(equal)} |")
    loop_notes = [f"- batch {r.batch}: {r.note}" for batch in plan.batches
                  for r in [median_round(report.timed("engine-loop", batch))] if r]
    text = (f"# Served against in-process\n\nDevice: {device}. Command: `{command}`.\n\n"
            f"{plan.prompt_len}-token prompts, {plan.new_tokens} new tokens, temperature 0, ignore_eos; median of "
            f"{plan.repeats} timed rounds after one warm-up round per batch size and mode. Settings: "
            f"{ {k: v for k, v in settings.items() if k != 'model'} }. Steps: the engine's forward count in process; "
            "served, the largest per-request nfe (a lower bound when requests join the batch in different steps). "
            "Outputs that differ at batch > 1 while the engine loop's equal point at the batch composition, which "
            "the in-process-staggered row of serving.csv checks.\n\n" + "\n".join(rows) +
            "\n\nEngine loop without a server, Triton calls per step the response thread would make:\n" +
            "\n".join(loop_notes) + "\n")
    if len(front_rows) > 2:
        text += ("\n## Through the OpenAI front\n\nThe same settings as `/v1/completions` requests of token-id prompts "
                 "(prompts of its own, so that the served rounds' prefix cache gives it no head start), from the "
                 "median round:\n\n" + "\n".join(front_rows) + "\n")
    (report.out / "serving.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, help="an existing checkpoint instead of a random one")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on any device, batches 1 and 2")
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, help="timed rounds per batch size and mode")
    parser.add_argument("--skip-engine-loop", action="store_true")
    parser.add_argument("--front", action="store_true", help="also measure through the OpenAI front")
    parser.add_argument("--py-spy", help="py-spy to profile the served stub with ('auto': from PATH or beside python)")
    parser.add_argument("--work-dir", type=Path, help="where the checkpoint and model repository go (default: a "
                                                      "temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    if args.batches:
        plan = Plan(**{**plan.__dict__, "batches": tuple(int(b) for b in args.batches.split(","))})
    if args.repeats:
        plan = Plan(**{**plan.__dict__, "repeats": args.repeats})
    os.environ.setdefault("TRITON_CACHE_DIR", str(KERNEL_CACHE_DIR))  # one kernel cache for both processes
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    py_spy = args.py_spy
    if py_spy == "auto":
        py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    command = "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = Report(args.out)
    settings: dict = {}
    work = Path(tempfile.mkdtemp(prefix="diffulex-serving-")) if args.work_dir is None else args.work_dir
    try:
        started = time.perf_counter()
        checkpoint = args.checkpoint or write_checkpoint(work / "checkpoint", plan.shape, device)
        print(f"checkpoint {checkpoint} ready in {time.perf_counter() - started:.1f} s", flush=True)
        repository = work / "model_repository"
        shutil.rmtree(repository, ignore_errors=True)
        repository.mkdir(parents=True)
        add_model(repository, MODEL, model=Path(checkpoint).resolve(), **plan.overrides)
        settings = served_settings(repository / MODEL / "config.pbtxt")
        prompts = make_prompts(plan, seed=0)
        reference: dict = {}

        started = time.perf_counter()
        engine = Diffulex(settings["model"], **{k: v for k, v in settings.items() if k != "model"})
        warm = engine.warm_up_report
        loaded = time.perf_counter() - warm.seconds
        print(f"in process: loaded in {loaded - started:.1f} s, warm-up {warm.seconds:.1f} s over batch sizes "
              f"{list(warm.batch_sizes)}", flush=True)
        run_generate(engine, plan, prompts, report, reference, front=args.front)
        if not args.skip_engine_loop:
            # A second engine: the first has the prompts in its prefix cache now, which would skip their prefill.
            del engine
            free_memory()
            engine = Diffulex(settings["model"], **{k: v for k, v in settings.items() if k != "model"})
            run_engine_loop(engine, plan, prompts, report, reference)
            run_staggered(engine, plan, prompts, report, reference)
        del engine
        free_memory()
        if torch.cuda.is_available():
            print(f"in process: freed; {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated here, "
                  f"{torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free on the device", flush=True)

        started = time.perf_counter()
        server = TritonServer(repository, args.out / "tritonserver.log")
        try:
            server.wait_ready(plan.startup_timeout_s)
            print(f"served: ready in {time.perf_counter() - started:.1f} s", flush=True)
            run_served(server, plan, prompts, report, reference)
            if args.front:
                front = FrontProcess(server.grpc_url, MODEL, args.out / "front.log")
                try:
                    front.wait_listening()
                    run_front(front, load_tokenizer(checkpoint), plan, prompts, report, reference)
                finally:
                    front.stop()
            if py_spy:
                try:
                    profile_served(server, py_spy, plan, prompts, report, reference, args.out)
                except Exception as err:  # the timings stand without the profile
                    print(f"profiling failed: {type(err).__name__}: {err}", flush=True)
        finally:
            server.stop()
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        if report.rounds:
            print(write_markdown(report, plan, device_name, command, settings),
                  flush=True)
    ratios = {b: (median_round(report.timed("served", b)).seconds / median_round(report.timed("in-process", b)).seconds)
              for b in plan.batches}
    if not all(math.isfinite(r) and r > 0 for r in ratios.values()):
        raise SystemExit(f"bad ratios {ratios}")


if __name__ == "__main__":
    main()
