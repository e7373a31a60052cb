"""Sparse attention by page retention (retention.py): a request keeps retention_ratio of its prompt's KV pages and
the rest go back to the pool; the attention then reads the kept pages only; ratio 1 is dense attention; a
request's tokens do not depend on what shares its batch or on the prefix cache; bad settings get clear errors."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffulex_backend import Config, SamplingParams
from diffulex_backend.attention import AttentionMetadata, paged_attention_reference
from diffulex_backend.retention import RetentionStats, select_pages
from engine_driver import run_one_at_a_time, run_requests, step_checked, tiny_engine

PROMPT = "a long prompt whose pages are mostly dropped: " * 2  # 92 byte tokens: 23 pages of 4
OTHER = "another request sharing the batch, dense"
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
LIMITS = dict(max_model_len=128, max_num_batched_tokens=256)


def sparse(ratio, **more):
    return SamplingParams(max_tokens=12, ignore_eos=True, retention_ratio=ratio, **more)


def test_ratio_one_is_dense_attention(tiny_checkpoints):
    path = tiny_checkpoints["llada"]
    dense = run_requests(tiny_engine(path, **LIMITS), [PROMPT], PARAMS)[0].token_ids
    engine = tiny_engine(path, **LIMITS, retention_ratio=1.0)
    request = engine.requests[engine.add_request(PROMPT, sparse(1.0))]
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in step_checked(engine) for t in out.token_ids]
        assert -1 not in request.page_table and request.num_dropped_pages == 0
    assert tokens == dense


@pytest.mark.parametrize("family, strategy", [("llada", "multi_bd"), ("dream", "multi_bd"), ("sdar", "multi_bd"),
                                              ("llada", "d2f"), ("llada", "dmax")])
@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_dropped_pages_go_back_to_the_pool_at_once(tiny_checkpoints, family, strategy, ratio):
    engine = tiny_engine(tiny_checkpoints[family], **LIMITS, decoding_strategy=strategy, enable_prefix_caching=False)
    rid = engine.add_request(PROMPT, sparse(ratio))
    request = engine.requests[rid]
    used = []
    while request.retention_pending:
        step_checked(engine)
        used.append(engine.metrics().kv_pages_used)
    context_pages = math.ceil(len(request.tokens[:request.num_prompt_tokens]) / 4)
    dropped = context_pages - max(2, math.ceil(ratio * context_pages))
    assert request.num_dropped_pages == dropped > 0
    assert request.page_table.count(-1) == dropped
    # The step that chose them freed them: the pool's accounting drops by exactly that many pages.
    assert used[-1] == len(request.page_table) - dropped
    assert request.page_table[0] >= 0 and request.page_table[context_pages - 1] >= 0  # sink and last page kept
    while engine.has_unfinished_requests():
        step_checked(engine)
    assert engine.metrics().kv_pages_used == 0


@pytest.mark.parametrize("strategy", ["multi_bd", "d2f", "dmax"])
def test_a_sparse_request_gives_the_same_tokens_alone_and_in_a_batch(tiny_checkpoints, strategy):
    path = tiny_checkpoints["llada"]
    prompts = [PROMPT, OTHER, "x" + PROMPT]
    params = [sparse(0.5), PARAMS, sparse(0.3, head_select=False)]
    settings = dict(LIMITS, decoding_strategy=strategy)
    alone = [s.token_ids for s in run_one_at_a_time(tiny_engine(path, **settings), prompts, params)]
    batched = [s.token_ids for s in run_requests(tiny_engine(path, **settings), prompts, params)]
    assert batched == alone
    dense = run_requests(tiny_engine(path, **settings), [PROMPT], PARAMS)[0].token_ids
    assert alone[0] != dense  # the random model attends everywhere: dropping half its context changes its output


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_a_sparse_request_gives_the_same_tokens_with_its_prompt_in_the_prefix_cache(tiny_checkpoints, family):
    # 93 tokens: the 92 before the last one fill 23 pages, all hit, so the first step's context is a whole number
    # of pages a token short of the prompt.
    path, prompt = tiny_checkpoints[family], PROMPT + "!"
    without = run_requests(tiny_engine(path, **LIMITS, enable_prefix_caching=False), [prompt], sparse(0.5))
    engine = tiny_engine(path, **LIMITS)
    run_requests(engine, [prompt], PARAMS)  # a dense request caches the prompt's pages
    hits = engine.metrics().prefix_cache_hit_tokens
    with_cache = run_requests(engine, [prompt], sparse(0.5))
    assert engine.metrics().prefix_cache_hit_tokens - hits == 92
    assert with_cache[0].token_ids == without[0].token_ids
    # The sparse request's dropped pages were shared with the prefix cache: a dense request still hits them all
    # and gives its dense tokens.
    dense = run_requests(tiny_engine(path, **LIMITS, enable_prefix_caching=False), [prompt], PARAMS)[0].token_ids
    assert run_requests(engine, [prompt], PARAMS)[0].token_ids == dense
    assert engine.metrics().kv_pages_used == 0


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_chunked_prefill_leaves_the_choice_unchanged(tiny_checkpoints, family):
    """A prompt prefilled in chunks (one ending a token before the prompt does, where a shifted model's context
    first reaches a whole number of pages) measures what one prefill does: once the whole prompt is cached."""
    path, prompt = tiny_checkpoints[family], PROMPT + "!"  # 93 tokens: the first 92 fill 23 pages
    one = run_requests(tiny_engine(path, **LIMITS), [prompt], sparse(0.5))[0].token_ids
    chunked = run_requests(tiny_engine(path, max_model_len=128, max_num_batched_tokens=len(prompt) - 1),
                           [prompt], sparse(0.5))[0].token_ids
    assert chunked == one


def test_a_preempted_sparse_request_never_drops_the_pages_of_its_generated_tokens(tiny_checkpoints):
    engine = tiny_engine(tiny_checkpoints["llada"], **LIMITS, enable_prefix_caching=False)
    request = engine.requests[engine.add_request(PROMPT, sparse(0.3))]
    prompt_pages = math.ceil(request.num_prompt_tokens / 4)
    while request.num_committed < 8:  # pages dropped, and two blocks generated
        step_checked(engine)
    assert request.num_dropped_pages
    engine.scheduler.preempt(request)  # as the scheduler does when the pool runs short
    assert engine.metrics().kv_pages_used == 0
    while engine.has_unfinished_requests():
        step_checked(engine)
        holes = [i for i, page in enumerate(request.page_table) if page < 0]
        assert all(i < prompt_pages for i in holes)
    assert request.num_dropped_pages == prompt_pages - math.ceil(0.3 * prompt_pages)  # chosen again on resuming
    assert engine.metrics().kv_pages_used == 0


def test_the_attention_reads_the_kept_pages_only():
    """The metadata a sparse sequence gets (its kept pages packed, its context shortened) gives attention over
    exactly the kept keys: checked against attention computed from those keys by hand."""
    torch.manual_seed(0)
    page_size, heads, kv_heads, dim, pages = 4, 4, 2, 8, 6
    k_cache = torch.randn(16, page_size, kv_heads, dim, dtype=torch.float64)
    v_cache = torch.randn(16, page_size, kv_heads, dim, dtype=torch.float64)
    table = [9, 3, 12, 5, 7, 1]  # the sequence's pages; the last holds 2 tokens: context 22
    kept = [0, 2, 5]
    q = torch.randn(3, heads, dim, dtype=torch.float64)
    k = torch.randn(3, kv_heads, dim, dtype=torch.float64)
    v = torch.randn(3, kv_heads, dim, dtype=torch.float64)
    context = 2 + page_size * (len(kept) - 1)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), context_lens=torch.tensor([context], dtype=torch.int32),
        page_tables=torch.tensor([[table[i] for i in kept] + [-1] * 3], dtype=torch.int32),
        slot_mapping=torch.full((3,), -1), block_ids=torch.zeros(3, dtype=torch.int32), max_seqlen_q=3,
        max_context_len=context, cu_seqlens_q_host=(0, 3), context_lens_host=(context,))
    out = paged_attention_reference(q, k, v, k_cache, v_cache, meta, 0.5)
    slots = [(table[i], s) for i in kept for s in range(page_size if i != pages - 1 else 2)]
    keys = torch.cat([torch.stack([k_cache[p, s] for p, s in slots]), k]).repeat_interleave(2, dim=1)
    values = torch.cat([torch.stack([v_cache[p, s] for p, s in slots]), v]).repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=0.5)
    torch.testing.assert_close(out, want.transpose(0, 1), rtol=1e-12, atol=1e-12)


def test_page_selection_keeps_the_sink_the_last_page_and_the_most_attended():
    # 6 pages, 3 heads. Page 2 is every head's second choice; page 3 is one head's strong first choice.
    scores = np.array([[0.30, 0.30, 0.30],
                       [0.01, 0.01, 0.01],
                       [0.10, 0.10, 0.05],
                       [0.00, 0.00, 0.60],
                       [0.12, 0.11, 0.00],
                       [0.20, 0.20, 0.20]])
    # Budget 3 of 6: one page besides the sink and the last one.
    assert select_pages(scores, 0.5, head_select=False).tolist() == [0, 3, 5]  # mean: 0.2 beats 0.083
    assert select_pages(scores, 0.5, head_select=True).tolist() == [0, 4, 5]  # heads 0, 1 name page 4, head 2 page 3
    # Two each: page 2 is named by all three heads, page 4 by two, page 3 by one.
    assert select_pages(scores, 0.6, head_select=True).tolist() == [0, 2, 4, 5]
    assert select_pages(scores, 1.0, head_select=True).tolist() == [0, 1, 2, 3, 4, 5]
    assert select_pages(scores, 0.01, head_select=True).tolist() == [0, 5]  # never fewer than the two


@pytest.mark.parametrize("field, value, allowed", [
    ("retention_ratio", 0, "a number in (0, 1]"), ("retention_ratio", 1.5, "a number in (0, 1]"),
    ("retention_ratio", float("nan"), "a number in (0, 1]"), ("retention_ratio", True, "a number in (0, 1]"),
    ("head_select", "yes", "true or false"),
])
def test_bad_engine_settings_name_the_field(llada_checkpoint, field, value, allowed):
    with pytest.raises(ValueError, match=rf"^config field '{field}' must be {re.escape(allowed)}, got "):
        Config(model=llada_checkpoint, **{field: value})


def test_a_strategy_that_keeps_no_pages_refuses_retention(llada_checkpoint):
    with pytest.raises(ValueError, match=r"^config field 'retention_ratio' must be 1 for decoding_strategy 'vanilla', "
                                         r"which does not drop pages \(page retention needs \['d2f', 'dmax', "
                                         r"'multi_bd'\]\), got 0.5$"):
        Config(model=llada_checkpoint, decoding_strategy="vanilla", retention_ratio=0.5)
    engine = tiny_engine(llada_checkpoint, decoding_strategy="vanilla")
    with pytest.raises(ValueError, match=r"^sampling parameter 'retention_ratio' must be 1 or null for "
                                         r"decoding_strategy 'vanilla', which does not drop pages$"):
        engine.add_request("hello", sparse(0.5))


@pytest.mark.parametrize("values, message", [
    ({"retention_ratio": 0.0}, "sampling parameter 'retention_ratio' must be a number in (0, 1] or null, got 0.0"),
    ({"retention_ratio": float("inf")},
     "sampling parameter 'retention_ratio' must be a number in (0, 1] or null, got inf"),
    ({"head_select": 1}, "sampling parameter 'head_select' must be true, false or null, got 1"),
])
def test_bad_request_values_name_the_parameter(values, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        SamplingParams(**values)



def test_the_measured_attention_is_each_sequences_mean_softmax_mass_per_page():
    """RetentionStats batches the forward's sequences, padded; each sequence's measure is still its own: the
    softmax of its queries over its context alone, averaged over its queries, summed per page."""
    torch.manual_seed(1)
    page_size, heads, kv_heads, dim = 4, 4, 2, 8
    k_cache = torch.randn(12, page_size, kv_heads, dim, dtype=torch.float64)
    sequences = [(3, 10, [5, 0, 7]), (5, 6, [2, 9])]  # (queries, context, pages)
    cu = [0, 3, 8]
    query = torch.randn(8, heads, dim, dtype=torch.float64)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), context_lens=torch.tensor([10, 6], dtype=torch.int32),
        page_tables=torch.tensor([[5, 0, 7], [2, 9, -1]], dtype=torch.int32), slot_mapping=torch.full((8,), -1),
        block_ids=torch.zeros(8, dtype=torch.int32), max_seqlen_q=5, max_context_len=10, cu_seqlens_q_host=tuple(cu),
        context_lens_host=(10, 6))
    stats = RetentionStats(page_size)
    stats.add(query, k_cache, meta, 0.25)
    for seq, (n, context, table) in enumerate(sequences):
        keys = torch.stack([k_cache[table[p // page_size], p % page_size] for p in range(context)])  # [ctx, kv, d]
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        q = query[cu[seq]:cu[seq + 1]]
        probs = (torch.einsum("nhd,chd->hnc", q, keys) * 0.25).softmax(-1).mean(1)  # [heads, ctx]
        want = torch.stack([probs[:, p * page_size:(p + 1) * page_size].sum(-1) for p in range(len(table))]).T
        got = stats.scores(seq, len(table))  # [pages, heads]
        torch.testing.assert_close(got, want.T.float(), rtol=1e-5, atol=1e-6)
