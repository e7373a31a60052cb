"""Tensor parallelism on the CPU: two ranks in two processes over gloo, token for token against one rank in float64,
for every family and decoding strategy; and the worker processes' lives (a rank that dies, fails or loses its parent
never leaves a hang or a stray process)."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
import torch
from processes import alive, live_children

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from diffulex_backend.workers import RankFailure, rank_threads

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
# Greedy, seeded sampling, and top-k/top-p (the sampler's reference path): every rank must draw the same tokens.
# EOS does not end them, so each compares all its tokens.
PARAMS = [SamplingParams(max_tokens=16, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=1.0, top_k=5, top_p=0.9, seed=11, ignore_eos=True)]
SETTINGS = dict(dtype="float64", max_num_reqs=4, max_model_len=64)

# (family, strategy, checkpoint shape, engine settings of the two-rank engine)
CASES = {
    "llada-multi_bd": ("llada", "multi_bd", {}, {}),
    "llada-d2f": ("llada", "d2f", {}, {}),
    "llada-vanilla": ("llada", "vanilla", {}, {}),
    "llada-fast_dllm": ("llada", "fast_dllm", {}, {}),
    "llada-dmax": ("llada", "dmax", {}, {}),
    # 259 rows do not split in two: the second rank's share ends in a padding row.
    "llada-odd-vocab": ("llada", "multi_bd", {"vocab_size": 259}, {}),
    "dream-multi_bd": ("dream", "multi_bd", {}, {}),
    # One KV head for two ranks: each rank holds it (replicated).
    "dream-one-kv-head": ("dream", "multi_bd", {"num_kv_heads": 1}, {}),
    "sdar-multi_bd": ("sdar", "multi_bd", {}, {}),
    "llada2-multi_bd": ("llada2", "multi_bd", {}, {}),
    "llada2-expert-parallel": ("llada2", "multi_bd", {}, {"expert_parallel": True}),
    "sdar_moe-multi_bd": ("sdar_moe", "multi_bd", {}, {}),
    "sdar_moe-expert-parallel": ("sdar_moe", "multi_bd", {}, {"expert_parallel": True}),
    "fast_dllm_v2-fast_dllm_v2": ("fast_dllm_v2", "fast_dllm_v2", {}, {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_checkpoints")
    made = {}

    def get(family: str, shape: dict) -> str:
        key = (family, tuple(sorted(shape.items())))
        if key not in made:
            made[key] = str(write_random_checkpoint(root / f"{family}-{len(made)}", family, **shape))
        return made[key]

    return get


def child_pids() -> set[int]:
    """The running child processes of this process."""
    return live_children(os.getpid())


def generate(checkpoint: str, **settings) -> list[list[int]]:
    engine = Diffulex(checkpoint, **SETTINGS, **settings)
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    finally:
        engine.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_the_tokens_of_one(checkpoints, case):
    family, strategy, shape, settings = CASES[case]
    checkpoint = checkpoints(family, shape)
    one = generate(checkpoint, decoding_strategy=strategy)
    two = generate(checkpoint, decoding_strategy=strategy, tensor_parallel_size=2, **settings)
    assert two == one
    assert [len(tokens) for tokens in one] == [p.max_tokens for p in PARAMS]


def test_two_ranks_choose_the_pages_one_rank_keeps(checkpoints):
    """Page retention measures attention on every rank's heads: two ranks drop the pages one rank drops, and
    decode the same tokens over them (in float64; in lower precision a near tie may rank pages otherwise)."""
    checkpoint = checkpoints("llada", {})
    prompts = [list(range(3, 50)), list(range(70, 110))]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, retention_ratio=0.5),
              SamplingParams(max_tokens=8, ignore_eos=True, retention_ratio=0.3, head_select=False)]
    tables, tokens = {}, {}
    for size in (1, 2):
        engine = Diffulex(checkpoint, **SETTINGS, page_size=4, tensor_parallel_size=size)
        try:
            requests = [engine.requests[engine.add_request(p, q)] for p, q in zip(prompts, params)]
            while any(r.retention_pending for r in requests):
                engine.step()
            tables[size] = [[page >= 0 for page in r.page_table] for r in requests]
            assert all(r.num_dropped_pages for r in requests)
            while engine.has_unfinished_requests():
                engine.step()
            tokens[size] = [r.tokens[r.num_prompt_tokens:].tolist() for r in requests]
        finally:
            engine.close()
    assert tables[2] == tables[1]
    assert tokens[2] == tokens[1]


def test_closing_the_engine_ends_its_workers(checkpoints):
    before = child_pids()
    shape = {"num_heads": 6, "num_kv_heads": 3, "hidden_size": 48, "intermediate_size": 96}
    engine = Diffulex(checkpoints("llada", shape), **SETTINGS, tensor_parallel_size=3)
    workers = [p.pid for p in engine.workers.processes]
    assert set(workers) <= child_pids() - before and len(workers) == 2
    engine.close()
    assert [p.returncode for p in engine.workers.processes] == [0, 0]  # they left their loop when told to
    assert child_pids() - before == set()


def test_an_engine_dropped_without_close_leaves_no_worker(checkpoints):
    import gc

    before = child_pids()
    engine = Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=2)
    assert child_pids() - before
    started = time.monotonic()
    del engine
    gc.collect()  # the workers wait for a plan that never comes: they are killed, not waited for
    assert child_pids() - before == set() and time.monotonic() - started < 5


def test_a_rank_that_dies_fails_the_engine_with_its_name_and_no_hang(checkpoints):
    before = child_pids()
    engine = Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=2)
    engine.add_request(PROMPTS[0], PARAMS[0])
    engine.step()
    worker = engine.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RankFailure, match=rf"^tensor-parallel rank 1 \(pid {worker.pid}\) exited with signal SIGKILL$"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 10
    engine.close()
    assert child_pids() - before == set()


def test_a_rank_gone_when_its_plan_is_sent_fails_the_engine_with_its_name(checkpoints, monkeypatch):
    """The plan's write down the pipe is the first to find the rank gone (the check of the workers before a step is
    switched off here): a closed pipe, not a hang, and the rank's exit status in the error."""
    engine = Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=2)
    try:
        engine.add_request(PROMPTS[0], PARAMS[0])
        engine.step()
        worker = engine.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        monkeypatch.setattr(engine.workers, "check_alive", lambda: None)
        with pytest.raises(RankFailure, match=rf"^tensor-parallel rank 1 \(pid {worker.pid}\) exited with signal "
                                              "SIGKILL$") as failed:
            engine.step()
        assert "no longer reads its plans" in str(failed.value.__cause__)
    finally:
        engine.close()


def test_a_rank_that_stops_reading_its_plans_fails_the_engine_with_its_name_after_the_send_s_timeout(checkpoints):
    """A worker alive but not reading (stopped here) leaves a plan larger than its pipe's room unsent: rank 0's send
    gives up after the channel's timeout (shortened here) with the RankFailure that names the rank, where a write
    that blocks would wait for ever. The pipe shrinks to one page here so that a prefill's plan outgrows it."""
    engine = Diffulex(checkpoints("llada", {}), **dict(SETTINGS, max_model_len=512), tensor_parallel_size=2)
    try:
        channel, worker = engine.workers.channel, engine.workers.processes[0]
        fcntl.fcntl(channel.pipes[0], fcntl.F_SETPIPE_SZ, 4096)
        channel.timeout_s = 0.3
        os.kill(worker.pid, signal.SIGSTOP)
        engine.add_request([3 + i % 200 for i in range(480)], PARAMS[0])  # a plan of 12 bytes a prompt token
        started = time.monotonic()
        with pytest.raises(RankFailure, match=r"^tensor-parallel rank 1 did not read its plan within 0\.3 s$"):
            engine.step()
        assert time.monotonic() - started < 10
        assert worker.poll() is None  # alive all along
    finally:
        engine.close()


def test_a_model_that_does_not_split_fails_the_start_and_leaves_no_worker(checkpoints):
    before = child_pids()
    with pytest.raises(ValueError, match=r"^config field 'tensor_parallel_size' is 3, but the model's 4 attention "
                                         r"heads do not split 3 ways$"):
        Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=3)
    deadline = time.monotonic() + 15
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() - before == set()


def test_workers_exit_when_the_engine_process_is_killed(checkpoints, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        from diffulex_backend import Diffulex
        engine = Diffulex({checkpoints("llada", {})!r}, dtype="float64", max_num_reqs=2, max_model_len=64,
                          tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in engine.workers.processes), flush=True)
        time.sleep(600)
    """))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in process.stdout.readline().split()]
        assert len(workers) == 1 and alive(workers[0])
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)


LORA_TARGETS = {"llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"],
                "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


@pytest.mark.parametrize("family", sorted(LORA_TARGETS))
def test_two_ranks_serve_lora_adapters_as_one_does(checkpoints, tmp_path, family):
    """Adapters split over ranks as their weights do (B's rows of a column-parallel projection, A's columns of a
    row-parallel one): a mixed batch of two adapters and none, and an adapter merged at load, give one rank's
    tokens."""
    from diffulex_backend.testing.checkpoint import write_peft_adapter

    checkpoint = checkpoints(family, {})
    adapters = [write_peft_adapter(tmp_path / name, checkpoint, LORA_TARGETS[family], rank=4, seed=seed)
                for seed, name in enumerate(("math", "code"), start=1)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, lora_name="math"),
              SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, lora_name="code")]
    unmerged = dict(lora_modules=f"math={adapters[0]},code={adapters[1]}")
    merged = dict(lora_path=str(adapters[0]), pre_merge_lora=True)
    results = []
    for settings, requests in ((unmerged, params), (merged, params[1:2])):
        out = {}
        for size in (1, 2):
            engine = Diffulex(checkpoint, **SETTINGS, **settings, tensor_parallel_size=size)
            try:
                out[size] = [o.token_ids for o in engine.generate(PROMPTS[:len(requests)], requests)]
            finally:
                engine.close()
        assert out[2] == out[1]
        results.append(out[2])
    # The adapters act: the three requests differ, and "math" merged gives what "math" chosen per request gives.
    assert len(set(map(tuple, results[0]))) == 3
    assert results[1][0] == results[0][0]


def test_expert_parallel_on_a_dense_model_is_refused(checkpoints):
    before = child_pids()
    with pytest.raises(ValueError, match=r"^config field 'expert_parallel' is true, but the model has no experts$"):
        Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=2, expert_parallel=True)
    deadline = time.monotonic() + 15
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() - before == set()


@pytest.mark.parametrize("confidence", ["prob", "margin", "neg_entropy"])
def test_greedy_steps_sample_from_each_ranks_share_of_the_logits(checkpoints, monkeypatch, confidence):
    """A step whose rows are all greedy never gathers the whole logits: the ranks trade a few numbers a row
    (sampling.greedy_over_shards), whatever the confidence. Its tokens are one rank's, in float64, for a dense and
    a MoE family."""
    import diffulex_backend.runner as runner

    calls = []
    original = runner.greedy_over_shards
    monkeypatch.setattr(runner, "greedy_over_shards",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    params = [SamplingParams(max_tokens=16, ignore_eos=True, confidence=confidence),
              SamplingParams(max_tokens=12, ignore_eos=True, confidence=confidence, remask_threshold=0.3)]
    for family, shape in (("llada", {"vocab_size": 259}), ("llada2", {})):
        checkpoint = checkpoints(family, shape)
        out = {}
        for size in (1, 2):
            # Two blocks in flight, where a remask threshold acts on the second.
            engine = Diffulex(checkpoint, **SETTINGS, buffer_size=2, tensor_parallel_size=size)
            try:
                out[size] = [o.token_ids for o in engine.generate(PROMPTS[:2], params)]
            finally:
                engine.close()
        assert out[2] == out[1]
    assert calls  # rank 0 took the path (the worker, which runs the same code, cannot be watched from here)


def test_a_start_that_fails_on_rank_0_alone_ends_at_once(checkpoints, monkeypatch):
    """Rank 0 fails after the other ranks went on to the next collective of the start (its KV cache sizing,
    measured per rank, can fail on its GPU alone): the engine fails with rank 0's error without waiting for the
    collective's timeout, and the workers are gone."""
    import diffulex_backend.model_setup as model_setup

    def no_room(*args):
        raise ValueError("config field 'gpu_memory_utilization' (0.9) leaves no room for one max_model_len sequence")

    monkeypatch.setattr(model_setup, "num_kv_pages", no_room)  # rank 0's own; the workers size theirs
    before = child_pids()
    started = time.monotonic()
    with pytest.raises(ValueError, match="leaves no room"):
        Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=2)
    assert time.monotonic() - started < 30
    assert child_pids() - before == set()


@pytest.mark.parametrize("family", ["llada", "llada2"])
@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[1]], ids=["greedy", "sampled"])
def test_a_decode_step_issues_the_collectives_its_layers_need_and_one_plan_broadcast(checkpoints, family, params):
    """Per step: the plan in one frame down the worker's pipe, and no collective for it; one all-reduce for the
    embedding lookup and one after attention and after the MLP (or MoE) of each layer; one all-gather for the
    sampler: of a few numbers a row when every row is greedy, of the rows' logits when one samples."""
    engine = Diffulex(checkpoints(family, {}), **SETTINGS, tensor_parallel_size=2)
    try:
        engine.add_request(PROMPTS[0], params)
        engine.step()
        engine.step()
        channel = engine.workers.channel
        sent = channel.sent
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine.step()
        assert engine.last_schedule.plans[0].blocks  # a step that decodes
        assert channel.sent == sent + 1
        counts = Counter(event.name for event in profile.events() if event.name.startswith("gloo:"))
        layers = engine.model.arch.num_layers
        assert counts == {"gloo:all_reduce": 2 * layers + 1, "gloo:all_gather": 1}
    finally:
        engine.close()


def test_rank_0_takes_its_share_of_the_cores_while_the_engine_runs_and_gives_it_back(checkpoints, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        engine = Diffulex(checkpoints("llada", {}), **SETTINGS, tensor_parallel_size=2)
        try:
            assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        finally:
            engine.close()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_omp_num_threads_sets_every_rank_s_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert rank_threads(2) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a thread count: the cores' share
    assert rank_threads(2) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_stopping_the_workers_kills_them_before_their_pipes_close(tmp_path):
    """Workers blocked on their plan pipes, as between steps: each dies by the kill, never reading the pipe's end (an
    EOFError, with its traceback, in an ordinary shutdown), and every kill comes before the first pipe closes."""
    from diffulex_backend.workers import stop_processes

    saw_eof = tmp_path / "saw-eof"
    worker = f"import sys; print(flush=True); sys.stdin.buffer.read(); open({str(saw_eof)!r}, 'a').write('eof')"
    processes = [subprocess.Popen([sys.executable, "-c", worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                 for _ in range(2)]
    events = []
    for index, process in enumerate(processes):
        assert process.stdout.readline() == b"\n"  # alive, and about to block on its pipe
        for name, owner in (("kill", process), ("wait", process), ("close", process.stdin)):
            def recorded(*args, _call=getattr(owner, name), _event=(name, index), **kwargs):
                events.append(_event)
                return _call(*args, **kwargs)
            setattr(owner, name, recorded)
    stop_processes(processes)
    assert [p.returncode for p in processes] == [-signal.SIGKILL] * 2
    assert not saw_eof.exists()
    assert [name for name, _ in events] == ["kill", "kill", "wait", "close", "wait", "close"]
    for process in processes:
        process.stdout.close()


def sum_partials_on_rank(rank: int, store_path: str, results) -> None:
    """One of two gloo ranks: a row-parallel product's split sums through TensorParallel.sum_partials, as the
    fused forward hands them over, in every form it takes."""
    import torch.distributed as dist

    from diffulex_backend.tensor_parallel import TensorParallel

    group = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2)
    tp = TensorParallel(rank=rank, size=2, group=group)
    generator = torch.Generator().manual_seed(rank)
    # Small whole numbers: every order of the sums gives the same value, in bf16 too (exact up to 256), so the test
    # sees which terms were summed.
    splits = torch.randint(-64, 64, (3, 5, 8), generator=generator).float()
    one = torch.randint(-64, 64, (1, 5, 8), generator=generator).to(torch.bfloat16)
    strided = torch.randint(-64, 64, (3, 8, 5), generator=generator).float().transpose(1, 2)
    results[rank] = {"splits": (splits.clone(), tp.sum_partials(splits)), "one": (one.clone(), tp.sum_partials(one)),
                     "strided": (strided.clone(), tp.sum_partials(strided))}


def test_a_row_parallel_product_s_split_sums_are_summed_over_the_splits_and_the_ranks():
    """Over gloo (no peer memory): split-K partials in float32, cuBLAS's single product in bf16, and partials that
    are not contiguous; each rank gets the sum of every split of every rank, of the shape of one split."""
    import tempfile

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, context.Manager() as manager:
        results = manager.dict()
        ranks = [context.Process(target=sum_partials_on_rank, args=(rank, f"{tmp}/store", results)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(120)
        assert [process.exitcode for process in ranks] == [0, 0]
        results = dict(results)
    for form in ("splits", "one", "strided"):
        inputs = [results[rank][form][0] for rank in (0, 1)]
        want = sum(partials.double().sum(0) for partials in inputs)
        for rank in (0, 1):
            out = results[rank][form][1]
            assert out.shape == inputs[rank].shape[1:] and out.dtype == inputs[rank].dtype
            assert torch.equal(out.double(), want), (form, rank)
