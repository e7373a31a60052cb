"""The offline API starts warm: Diffulex(...) runs the warm-up requests before it returns, unless told not to, and
the warm-up changes no later request's output: unseeded requests draw the same seeds, request ids start where they
would, and every page is back in the pool."""

import logging

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint

SETTINGS = {"block_size": 4, "page_size": 4, "buffer_size": 2, "max_model_len": 256, "max_num_reqs": 8,
            "num_kv_pages": 512}
SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)  # unseeded: draws from the seed stream


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Head size 64: on a GPU the Triton kernels and CUDA graphs serve it, so the warm-up has something to warm.
    return write_random_checkpoint(tmp_path_factory.mktemp("warm") / "llada", "llada", hidden_size=128, num_heads=2,
                                   num_kv_heads=2, head_dim=64, intermediate_size=256)


def test_a_warmed_engine_gives_a_cold_engines_outputs_and_ids(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="diffulex_backend"):
        warm = Diffulex(str(checkpoint), **SETTINGS)
    cold = Diffulex(str(checkpoint), warm_up=False, **SETTINGS)
    assert cold.warm_up_report is None and warm.warm_up_report.batch_sizes
    assert "warm-up took" in caplog.text
    assert warm.kv_cache.num_used_pages == 0 and not warm.has_unfinished_requests()
    prompts = ["the first prompt", "a second one", "and a third"]
    warm_outputs, cold_outputs = warm.generate(prompts, SAMPLED), cold.generate(prompts, SAMPLED)
    assert [(o.request_id, o.token_ids, o.nfe) for o in warm_outputs] == [
        (o.request_id, o.token_ids, o.nfe) for o in cold_outputs]



@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels compile on a GPU only")
def test_after_the_warm_up_no_prompt_compiles_a_kernel(checkpoint):
    """A request whose prompt length the warm-up never saw still finds every kernel compiled: a compile in the
    middle of serving stalls every request in the batch for seconds."""
    import triton

    engine = Diffulex(str(checkpoint), **{**SETTINGS, "max_model_len": 512})
    vocab = engine.model.arch.vocab_size
    compiled = []

    def record(*, repr, **_):
        compiled.append(repr)
        return False  # compile as usual

    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    triton.knobs.runtime.jit_cache_hook = record
    try:
        # Lengths on and off the multiples of 16 that Triton specializes integers on, short and long, alone and
        # batched, and a prompt served twice, whose second prefill reads the first one's cached pages.
        for lengths in ([1], [5], [17], [100], [255], [470], [64, 3, 130], [300, 300]):
            prompts = [[(7 * i + n) % (vocab - 2) + 1 for i in range(n)] for n in lengths]
            engine.generate(prompts, greedy)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert compiled == [], "\n".join(compiled)


@pytest.mark.parametrize("max_num_reqs, block_size, buffer_size, sizes", [
    (64, 32, 1, (1, 2, 4, 8, 16, 32, 64)),  # LLaDA's defaults: 64 blocks of 32 fit the budget of 4096 tokens
    (48, 32, 2, (1, 2, 4, 8, 16, 32, 48)),
    (64, 256, 1, (1, 2, 4, 8, 16)),  # DiffusionGemma's canvases: 16 of them fill the budget
    (64, 4096, 1, (1,)),
])
def test_warm_up_batch_sizes_stop_where_a_step_s_token_budget_is_full(max_num_reqs, block_size, buffer_size, sizes):
    """With CUDA graphs, each batch size the scheduler forms captures its buckets; a batch past the token budget
    steps in the buckets of a smaller one, and warming it up would only cost time."""
    from types import SimpleNamespace

    from diffulex_backend.warm_up import warm_up_batch_sizes

    engine = SimpleNamespace(model=SimpleNamespace(replays_graphs=lambda: True), config=SimpleNamespace(
        max_num_reqs=max_num_reqs, max_num_batched_tokens=4096, block_size=block_size, buffer_size=buffer_size))
    assert warm_up_batch_sizes(engine) == sizes
    engine.model.replays_graphs = lambda: False
    assert warm_up_batch_sizes(engine) == (1,)
