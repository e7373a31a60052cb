"""The runner's own per-request state (the hidden state a shifted model carries past its last committed position)
lives only as long as its request runs: finishing, aborting and preemption each drop it, so nothing leaks. The
runner forgets a request at the start of the next step, whose plan names it (SchedulerOutput.released)."""
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
    # What is left belongs to the requests that finished in the last step, which the next plan releases; running
    # one more forgets them all, and leaves only its own for the plan after.
    finished_last = set(llm.scheduler.released)
    assert not llm.requests and set(llm.runner.carry_hidden) <= finished_last
    [out] = run_requests(llm, PROMPTS[:1], PARAMS)
    assert set(llm.runner.carry_hidden) <= {out.request_id} == set(llm.scheduler.released)


def test_aborted_requests_leave_no_runner_state(tiny_checkpoints):
    llm = tiny_engine(tiny_checkpoints["dream"])
    ids = [llm.add_request(prompt, PARAMS) for prompt in PROMPTS]
    step_checked(llm)
    step_checked(llm)
    pages_used = llm.metrics().kv_pages_used
    llm.abort(ids[0])
    assert llm.metrics().kv_pages_used < pages_used  # its pages are free at once
    step_checked(llm)
    assert llm.last_schedule.released == [ids[0]]
    assert sorted(llm.runner.carry_hidden) == sorted(ids[1:])
    for request_id in ids[1:]:
        llm.abort(request_id)
    assert llm.metrics().kv_pages_used == 0
    # No step runs without a request: the ids wait for the next plan that runs, and then none is left of them.
    [out] = run_requests(llm, PROMPTS[:1], PARAMS)
    assert set(llm.runner.carry_hidden) <= {out.request_id}


def test_preempted_requests_leave_no_runner_state_until_they_run_again(tiny_checkpoints):
    # 4 requests of up to 39 + 16 tokens need up to 14 pages of 4 each; 16 pages cannot hold them all.
    llm = tiny_engine(tiny_checkpoints["dream"], num_kv_pages=16, buffer_size=2)
    for prompt in PROMPTS:
        llm.add_request(prompt, PARAMS)
    checked = 0  # steps that preempted and ran
    for _ in range(400):
        if not llm.has_unfinished_requests():
            break
        was_running = {r.request_id for r in llm.scheduler.running}
        step_checked(llm)
        running = {p.request_id for p in llm.last_schedule.plans}
        assert set(llm.runner.carry_hidden) <= running | {r.request_id for r in llm.scheduler.running}
        preempted = was_running & {r.request_id for r in llm.scheduler.waiting}
        if preempted and llm.last_schedule.plans:  # a step that runs forgets them first
            assert preempted <= set(llm.last_schedule.released)
            assert not preempted & set(llm.runner.carry_hidden)
            checked += 1
    assert checked
    assert set(llm.runner.carry_hidden) <= set(llm.scheduler.released)  # the last step's finished, for the next
