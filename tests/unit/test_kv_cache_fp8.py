"""kv_cache_dtype "fp8": K/V rows in float8_e4m3fn, each (token, head) with its own scale. A page costs (head_dim + 4)
/ (2 head_dim) of a bf16 page; attention over the rows stays within FP8's rounding of attention over the float
rows; the trained demo model answers as it does over a float cache; two ranks decode one rank's tokens; page
retention scores the rows' values; a family whose cache cannot hold the rows is refused by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import AttentionMetadata, cache_rows, paged_attention_reference, store_kv
from diffulex_backend.retention import RetentionStats
from diffulex_backend.runner import kv_cache_layout
from diffulex_backend.testing.checkpoint import random_model, write_random_checkpoint
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from demo_task import TEST_SEED, held_out_problems  # noqa: E402

DEMO = REPO / "model_repository" / "diffulex" / "demo-llada"


def one_sequence(context: int, fed: int, page_size: int) -> AttentionMetadata:
    """One sequence: `context` cached tokens on pages 0.., then `fed` tokens in one block, all stored."""
    pages = -(-(context + fed) // page_size)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, fed], dtype=torch.int32), context_lens=torch.tensor([context], dtype=torch.int32),
        page_tables=torch.arange(pages, dtype=torch.int32)[None], slot_mapping=torch.arange(context, context + fed),
        block_ids=torch.full((fed,), context, dtype=torch.int32), max_seqlen_q=fed, max_context_len=context,
        cu_seqlens_q_host=(0, fed), context_lens_host=(context,))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_page_of_fp8_rows_costs_about_half_a_bf16_page(head_dim):
    model = random_model("llada", hidden_size=4 * head_dim, num_heads=4, num_kv_heads=4, num_layers=2,
                         intermediate_size=64, vocab_size=300)
    (shape, dtype), (fp8_shape, fp8_dtype) = (kv_cache_layout(model, 10, 32, torch.bfloat16, kind)
                                              for kind in ("auto", "fp8"))
    assert (dtype, fp8_dtype) == (torch.bfloat16, torch.uint8)
    assert fp8_shape == (*shape[:-1], head_dim + 4)
    bf16_bytes, fp8_bytes = (torch.empty(s, dtype=d).nbytes for s, d in ((shape, dtype), (fp8_shape, fp8_dtype)))
    assert fp8_bytes / bf16_bytes == (head_dim + 4) / (2 * head_dim)


def test_attention_over_fp8_rows_stays_within_fp8_rounding_of_the_float_rows():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, page_size, context, fed = 8, 2, 64, 16, 300, 32
    meta = one_sequence(context, fed, page_size)
    pages = -(-(context + fed) // page_size)
    query = torch.randn(fed, heads, head_dim, generator=gen)
    key, value = (torch.randn(fed, kv_heads, head_dim, generator=gen) for _ in range(2))
    cached_k, cached_v = (torch.randn(pages, page_size, kv_heads, head_dim, generator=gen) for _ in range(2))
    outs = {}
    for kind in ("auto", "fp8"):
        k_cache, v_cache = (torch.zeros(pages, page_size, kv_heads, head_dim + 4, dtype=torch.uint8) if kind == "fp8"
                            else torch.zeros(pages, page_size, kv_heads, head_dim) for _ in range(2))
        context_meta = one_sequence(0, context, page_size)
        store_kv(cached_k.view(-1, kv_heads, head_dim)[:context], cached_v.view(-1, kv_heads, head_dim)[:context],
                 k_cache, v_cache, context_meta.slot_mapping)
        outs[kind] = paged_attention_reference(query, key, value, k_cache, v_cache, meta, head_dim ** -0.5)
        if kind == "fp8":  # the rows read back are the float rows, to FP8's 3 mantissa bits
            rows = cache_rows(k_cache, torch.arange(context))
            torch.testing.assert_close(rows, cached_k.view(-1, kv_heads, head_dim)[:context], rtol=2 ** -4,
                                       atol=2 ** -10 * rows.abs().amax())
    # e4m3 rounds each value by up to 2^-4 of itself, 3.6% rms: the output moves by about as much (3.5% here).
    error = ((outs["fp8"] - outs["auto"]).norm() / outs["auto"].norm()).item()
    assert 0 < error < 5e-2


def additions(count: int) -> list[tuple[str, str]]:
    return [("12+34=", "46")] + [(p.prompt, p.answer) for p in held_out_problems(count - 1, TEST_SEED)]


def test_the_demo_model_answers_over_fp8_rows_as_over_a_float_cache():
    problems = additions(24)
    answers = {}
    for kind in ("auto", "fp8"):
        engine = Diffulex(str(DEMO), kv_cache_dtype=kind)
        try:
            answers[kind] = [o.text for o in engine.generate([p for p, _ in problems], SamplingParams(max_tokens=16))]
            assert engine.runner.kv_cache.dtype == (torch.uint8 if kind == "fp8" else torch.float32)
        finally:
            engine.close()
    assert answers["fp8"] == answers["auto"] == [answer for _, answer in problems]


def test_two_ranks_over_fp8_rows_decode_one_rank_s_tokens(tmp_path):
    """Each rank quantizes the rows of its own heads, which are one rank's rows: in float64, the same tokens."""
    checkpoint = str(write_random_checkpoint(tmp_path / "llada", "llada"))
    params = [SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)]
    prompts = [list(range(5, 30)), list(range(40, 52))]
    tokens = {}
    for size in (1, 2):
        engine = Diffulex(checkpoint, dtype="float64", max_num_reqs=4, max_model_len=64, kv_cache_dtype="fp8",
                          tensor_parallel_size=size)
        try:
            tokens[size] = [o.token_ids for o in engine.generate(prompts, params)]
        finally:
            engine.close()
    assert tokens[2] == tokens[1]


def test_page_retention_scores_the_values_fp8_rows_hold():
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, page_size, context, fed = 4, 2, 64, 8, 40, 8
    meta = one_sequence(context, fed, page_size)
    pages = -(-(context + fed) // page_size)
    packed = torch.zeros(pages, page_size, kv_heads, head_dim + 4, dtype=torch.uint8)
    rows = torch.randn(pages * page_size, kv_heads, head_dim, generator=gen) * 3
    store_kv(rows, rows, packed, packed.clone(), torch.arange(pages * page_size))
    plain = cache_rows(packed, torch.arange(pages * page_size)).view(pages, page_size, kv_heads, head_dim)
    query = torch.randn(fed, heads, head_dim, generator=gen)
    scored = []
    for cache in (packed, plain):
        stats = RetentionStats(page_size)
        stats.add(query, cache, meta, head_dim ** -0.5)
        scored.append(stats.scores(0, context // page_size))
    assert torch.equal(scored[0], scored[1])


def test_diffusion_gemma_refuses_fp8_rows_by_name(tmp_path):
    checkpoint = str(write_random_diffusion_gemma_checkpoint(tmp_path / "gemma"))
    with pytest.raises(ValueError, match=r"^config field 'kv_cache_dtype' is 'fp8', but DiffusionGemmaModel's cache "
                                         r"is laid out per layer and holds the model's dtype only; leave "
                                         r"kv_cache_dtype 'auto'$"):
        Diffulex(checkpoint, kv_cache_dtype="fp8")
