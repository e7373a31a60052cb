"""Drives an engine step by step the way a server does, and checks the scheduler's budgets after every step.

Every engine test that runs requests goes through `run_requests`, so the token and request budgets are asserted
at every step of every run, and a request that stops making progress fails its test instead of hanging it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from diffulex_backend import Diffulex, FinishReason, SamplingParams, StepOutput

# Small limits that keep every run to a few dozen short forwards. float64: random models put many
# confidences within a float32 rounding of each other, and comparisons of decoding decisions between two
# runs should not hinge on the order of a reduction. The CPU on every machine: these tests state the engine's
# exact semantics, and on a GPU each engine would also size its KV pool to most of the device's memory, leaving
# none for the next test's engine. The GPU path is tested in tests/kernels.
TINY_LIMITS = dict(block_size=4, page_size=4, max_model_len=96, max_num_batched_tokens=128, dtype="float64",
                   device="cpu")


def tiny_engine(path: str, **overrides) -> Diffulex:
    return Diffulex(path, **{**TINY_LIMITS, **overrides})


@dataclass
class Stream:
    """Everything one request streamed, in order."""

    request_id: str
    deltas: list[StepOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.deltas[-1].finish_reason if self.deltas else None

    @property
    def nfe(self) -> int:
        return self.deltas[-1].nfe if self.deltas else 0


def assert_budgets_hold(llm: Diffulex) -> None:
    """The last step's batch stayed inside every budget of the config."""
    config, sched = llm.config, llm.last_schedule
    assert sched.num_tokens <= config.max_num_batched_tokens
    assert len(sched.plans) <= config.max_num_reqs
    assert llm.metrics().num_running <= config.max_num_reqs
    ids = [p.request_id for p in sched.plans]
    assert len(ids) == len(set(ids)), f"a request appears twice in one forward: {ids}"


def step_checked(llm: Diffulex) -> list[StepOutput]:
    deltas = llm.step()
    assert_budgets_hold(llm)
    return deltas


def drain(llm: Diffulex, streams: dict[str, Stream], max_steps: int = 400) -> None:
    """Step until no request is left, collecting deltas into `streams` (keyed by request id)."""
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return
        for delta in step_checked(llm):
            stream = streams[delta.request_id]
            assert not (stream.deltas and stream.deltas[-1].finished), "a delta came after the final one"
            stream.deltas.append(delta)
    stuck = {rid: r.tokens[r.num_prompt_tokens:].tolist() for rid, r in llm.requests.items()}
    raise AssertionError(f"requests still unfinished after {max_steps} steps; their generation areas: {stuck}")


def run_requests(llm: Diffulex, prompts: list, params: SamplingParams | list[SamplingParams],
                 max_steps: int = 400) -> list[Stream]:
    """Add every prompt at once and step to the end; one Stream per prompt, in order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    streams = {}
    for prompt, p in zip(prompts, params_list):
        rid = llm.add_request(prompt, p)
        streams[rid] = Stream(rid)
    drain(llm, streams, max_steps)
    return list(streams.values())


def run_one_at_a_time(llm: Diffulex, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Stream]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    return [run_requests(llm, [prompt], [p])[0] for prompt, p in zip(prompts, params_list)]
