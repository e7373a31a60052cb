"""The runner's own per-request state (the hidden state a shifted model carries past its last committed position)
lives only as long as its request runs: finishing, aborting and preemption each drop it, so nothing leaks."""
from __future__ import annotations

from diffulex_backend import SamplingParams
from engine_driver import run_requests, step_checked, tiny_engine

PROMPTS = ["hello world", "the quick brown fox", "ab", "diffusion language models decode blocks"]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def test_finished_requests_leave_no_runner_state(tiny_checkpoints):
    llm = tiny_engine(tiny_checkpoints["dream"], buffer_size=2)  # dream is shifted: it carries hidden states
    for prompt in PROMPTS:
        llm.add_request(prompt, PARAMS)
    step_checked(llm)
    assert sorted(llm.runner.carry_hidden) == sorted(llm.requests)  # the state exists while they run
    for _ in range(200):
        if not llm.has_unfinished_requests():
            break
        step_checked(llm)
    assert not llm.requests and llm.runner.carry_hidden == {}
    run_requests(llm, PROMPTS[:1], PARAMS)  # and after the ordinary way of running one
    assert llm.runner.carry_hidden == {}


def test_aborted_requests_leave_no_runner_state(tiny_checkpoints):
    llm = tiny_engine(tiny_checkpoints["dream"])
    ids = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
    step_checked(llm)
    step_checked(llm)
    llm.abort(ids[0])
    assert sorted(llm.runner.carry_hidden) == sorted(ids[1:])
    for request_id in ids[1:]:
        llm.abort(request_id)
    assert llm.runner.carry_hidden == {}


def test_preempted_requests_leave_no_runner_state_until_they_run_again(tiny_checkpoints):
    # 4 requests of up to 39 + 16 tokens need up to 14 pages of 4 each; 16 pages cannot hold them all.
    llm = tiny_engine(tiny_checkpoints["dream"], num_kv_pages=16, buffer_size=2)
    for prompt in PROMPTS:
        llm.add_request(prompt, PARAMS)
    seen_preemption = False
    for _ in range(400):
        if not llm.has_unfinished_requests():
            break
        step_checked(llm)
        running = {p.request_id for p in llm.last_schedule.plans}
        assert set(llm.runner.carry_hidden) <= running | {r.request_id for r in llm.scheduler.running}
        for request_id in llm.last_schedule.preempted:
            seen_preemption = True
            assert request_id not in llm.runner.carry_hidden
    assert seen_preemption
    assert llm.runner.carry_hidden == {}
