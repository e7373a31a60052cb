"""flash_attn's paths of attention on the CPU: how the host takes a forward apart (attention.DenseAttention), the two
dense varlen attentions that FlashAttention computes from it, the paged call over a wide group's cached context that
the blocks kernel goes on from, and whole engines that take both, token for token.

flash-attn's kernel runs on a GPU only (tests/kernels/test_flash_attention_gpu.py holds it to the Triton kernel
there). Here `varlen_reference` computes what its `flash_attn_varlen_func` computes, by its documented semantics,
dense and paged, so that everything around the kernel runs as the engine runs it.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import (AttentionMetadata, HeadMask, context_attention_reference, dense_attention_of,
                                        paged_attention_reference, store_kv)
from diffulex_backend.flash_attention import FlashAttention, flash_attn_installed, refusal

from engine_driver import TINY_LIMITS, run_requests


def varlen_reference(q, k, v, *, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, cu_seqlens_k=None,
                     seqused_k=None, page_table=None, return_lse=False):
    """flash-attn's varlen attention: sequence b's queries q[cu_q[b]:cu_q[b+1]] over its keys k[cu_k[b]:cu_k[b+1]],
    all of them, or under a causal mask aligned so that the last query sees the last key. Paged (`page_table`), over
    the first seqused_k[b] keys of sequence b's pages, all visible, returning (out, lse)."""
    if page_table is not None:
        assert cu_seqlens_k is None and not causal and return_lse
        assert max(seqused_k.tolist(), default=0) <= max_seqlen_k <= page_table.shape[1] * k.shape[1]
        return context_attention_reference(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max(b - a for a, b in zip(cu_q, cu_q[1:])) <= max_seqlen_q
    assert max(b - a for a, b in zip(cu_k, cu_k[1:])) <= max_seqlen_k
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype)
    for b in range(len(cu_q) - 1):
        n, m = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if n == 0:
            continue
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        vb = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        mask = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n) if causal else None
        out[cu_q[b]:cu_q[b + 1]] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask,
                                                                  scale=softmax_scale).transpose(0, 1)
    return out


class CountingReference:
    """varlen_reference, counting its dense and its paged calls: a test that means either path shows that it ran."""

    def __init__(self):
        self.dense_calls = self.paged_calls = 0

    def __call__(self, *args, **kwargs):
        if kwargs.get("page_table") is None:
            self.dense_calls += 1
        else:
            self.paged_calls += 1
        return varlen_reference(*args, **kwargs)


def ids(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(part, dtype=np.int32) for part in parts])


CAUSAL_PROMPT_AND_BLOCK = ids(np.arange(6), [6] * 4)  # multi_bd's first forward: a causal prompt, its first block
FULL_PROMPT_AND_BLOCK = ids([0] * 5, [5] * 4)  # d2f's: a bidirectional prompt, its first block


@pytest.mark.parametrize("block_ids, context, want", [
    # (mask of the heads, head rows, tail rows, cu_head, cu_tail); None: not dense
    ([ids([0] * 5), ids([0] * 3)], 0, (HeadMask.FULL, None, None, [0, 5, 8], None)),
    ([ids(np.arange(5)), ids(np.arange(3))], 0, (HeadMask.CAUSAL, None, None, [0, 5, 8], None)),
    ([CAUSAL_PROMPT_AND_BLOCK], 0, (HeadMask.CAUSAL, list(range(6)), [6, 7, 8, 9], [0, 6], [0, 4])),
    ([FULL_PROMPT_AND_BLOCK, ids([0] * 2)], 0,
     (HeadMask.FULL, [0, 1, 2, 3, 4, 9, 10], [5, 6, 7, 8], [0, 5, 7], [0, 4, 4])),
    ([ids([0], [3] * 3), CAUSAL_PROMPT_AND_BLOCK], 0,  # a one-token head takes either mask
     (HeadMask.CAUSAL, [0] + list(range(4, 10)), [1, 2, 3, 10, 11, 12, 13], [0, 1, 7], [0, 3, 7])),
    ([ids([0, 0], [4, 4])], 0, (HeadMask.FULL, [0, 1], [2, 3], [0, 2], [0, 2])),  # fast_dllm_v2's two blocks
    ([CAUSAL_PROMPT_AND_BLOCK, FULL_PROMPT_AND_BLOCK], 0, None),  # two head masks: no one launch takes both
    ([ids([0, 0], [4, 4], [8, 8])], 0, None),  # blocks in flight: block-causal, three groups
    ([ids(np.arange(4), [4, 4], [6, 6])], 0, None),
    ([ids([0, 2, 1])], 0, None),  # ids that go down
    ([ids([0] * 5)], 7, None),  # a cached context
])
def test_the_host_takes_a_forward_apart_into_dense_heads_and_tails(block_ids, context, want):
    dense = dense_attention_of(block_ids, context)
    if want is None:
        assert dense is None
        return
    mask, head_rows, tail_rows, cu_head, cu_tail = want
    assert dense.head_mask is mask
    assert (None if dense.head_rows is None else dense.head_rows.tolist()) == head_rows
    assert (None if dense.tail_rows is None else dense.tail_rows.tolist()) == tail_rows
    assert dense.cu_head.tolist() == cu_head
    assert (None if dense.cu_tail is None else dense.cu_tail.tolist()) == cu_tail
    assert dense.max_head == max(b - a for a, b in zip(cu_head, cu_head[1:]))
    assert dense.max_tail == (0 if cu_tail is None else max(b - a for a, b in zip(cu_tail, cu_tail[1:])))


def compare_with_the_paged_reference(block_ids: list[np.ndarray], heads: int, kv_heads: int, seed: int) -> int:
    """FlashAttention over the forward `block_ids` make (no cached context) against the paged reference, in
    float64: the same output and the same cache written. Returns the dense launches it made (0: not dense)."""
    torch.manual_seed(seed)
    lengths = [len(x) for x in block_ids]
    tokens, head_dim, page_size = sum(lengths), 8, 4
    cu = [0, *np.cumsum(lengths).tolist()]
    pages = [-(-n // page_size) for n in lengths]
    first_page = [0, *np.cumsum(pages).tolist()]
    tables = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(first_page[b], first_page[b] + n)
    slots = torch.cat([tables[b, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
                       for b, n in enumerate(lengths)])
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), context_lens=torch.zeros(len(lengths), dtype=torch.int32),
        page_tables=tables, slot_mapping=slots, block_ids=torch.from_numpy(np.concatenate(block_ids)),
        max_seqlen_q=max(lengths), max_context_len=0, cu_seqlens_q_host=tuple(cu),
        context_lens_host=(0,) * len(lengths))
    # q, k and v as the fused projection leaves them: strided views of one [T, q + 2 kv] product.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.float64)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    cache_shape = (first_page[-1], page_size, kv_heads, head_dim)
    want_k, want_v = torch.zeros(cache_shape, dtype=torch.float64), torch.zeros(cache_shape, dtype=torch.float64)
    want = paged_attention_reference(q, k, v, want_k, want_v, meta, 0.3)

    dense = dense_attention_of(block_ids, 0)
    varlen = CountingReference()
    attention = FlashAttention(paged_attention_reference, varlen=varlen, store_kv=store_kv)
    got_k, got_v = torch.zeros(cache_shape, dtype=torch.float64), torch.zeros(cache_shape, dtype=torch.float64)
    meta = dataclasses.replace(meta, dense=None if dense is None else dense.to(torch.device("cpu")))
    got = attention(q, k, v, got_k, got_v, meta, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    return varlen.dense_calls


@pytest.mark.parametrize("block_ids", [
    [ids([0] * 7), ids([0] * 3)],
    [ids(np.arange(7)), ids(np.arange(2))],
    [CAUSAL_PROMPT_AND_BLOCK, ids(np.arange(3), [3] * 4), ids([0])],
    [FULL_PROMPT_AND_BLOCK, ids([0] * 2), ids([0, 0], [2, 2, 2])],
], ids=["full", "causal", "causal-with-blocks", "full-with-blocks"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_two_dense_attentions_equal_the_paged_reference_and_store_the_same_cache(block_ids, heads, kv_heads):
    dense = dense_attention_of(block_ids, 0)
    assert dense is not None
    assert compare_with_the_paged_reference(block_ids, heads, kv_heads, seed=0) == (
        1 if dense.tail_rows is None else 2)


def sequence_block_ids():
    """One sequence's block ids: a full or causal head, possibly gapped, with or without a trailing block; or ids
    of any other shape (blocks in flight, ids that go down), which the host must send to the blocks kernel."""
    head = st.one_of(st.integers(1, 9).map(lambda n: np.zeros(n, dtype=np.int32)),
                     st.lists(st.integers(1, 3), min_size=0, max_size=8).map(
                         lambda steps: np.cumsum([0, *steps]).astype(np.int32)))
    with_tail = st.tuples(head, st.integers(0, 6), st.integers(1, 5)).map(
        lambda parts: np.concatenate([parts[0], np.full(parts[1], parts[0][-1] + parts[2], dtype=np.int32)]))
    other = st.lists(st.integers(0, 12), min_size=1, max_size=10).map(lambda x: np.array(x, dtype=np.int32))
    blocks = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(
        lambda sizes: np.repeat(np.arange(len(sizes)) * 4, sizes).astype(np.int32))
    return st.one_of(with_tail, other, blocks.map(np.sort))


@settings(max_examples=300, deadline=None)
@given(block_ids=st.lists(sequence_block_ids(), min_size=1, max_size=4), gqa=st.booleans(), seed=st.integers(0, 99))
def test_any_forward_the_host_finds_dense_gives_the_paged_reference_s_attention(block_ids, gqa, seed):
    dense = dense_attention_of(block_ids, 0)
    calls = compare_with_the_paged_reference(block_ids, 4, 2 if gqa else 4, seed)
    assert calls == (0 if dense is None else 1 if dense.tail_rows is None else 2)


def test_a_forward_that_is_not_dense_goes_to_the_blocks_kernel():
    calls = []

    def blocks(*args, **kwargs):
        calls.append(kwargs)
        return "blocks"

    attention = FlashAttention(blocks, varlen=CountingReference(), store_kv=store_kv)
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 2]), context_lens=torch.tensor([4]),
                             page_tables=torch.zeros(1, 2), slot_mapping=torch.full((2,), -1),
                             block_ids=torch.zeros(2), max_seqlen_q=2, max_context_len=4)
    assert attention(None, None, None, None, None, meta, 1.0, kv_stored=True) == "blocks"
    assert calls == [{"kv_stored": True}] and attention.varlen.dense_calls == 0


def forward_over_a_context(heads: int, kv_heads: int, seed: int, cache_dtype=torch.float64):
    """A forward of blocks over cached contexts, in float64: sequences with blocks in flight (block-causal), one
    block, no query, no context; every third in-forward token stored, the rest in flight. Returns (q, k, v, caches,
    meta)."""
    gen = torch.Generator().manual_seed(seed)
    page_size, head_dim, block = 4, 8, 3
    sequences = [(6, 13), (3, 8), (0, 5), (4, 0), (3, 1)]  # (query tokens, cached context)
    pages = [-(-(q + c) // page_size) for q, c in sequences]
    order = torch.randperm(sum(pages) + 2, generator=gen).tolist()
    # Twice the columns the pages take, as a CUDA graph's tables hold max_model_len's pages.
    tables = torch.full((len(sequences), 2 * max(pages)), -1, dtype=torch.int32)
    slots, block_ids, cu = [], [], [0]
    for b, ((n, context), count) in enumerate(zip(sequences, pages)):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
        positions = torch.arange(context, context + n)
        slots += (tables[b, positions // page_size].long() * page_size + positions % page_size).tolist()
        block_ids += (positions // block * block).tolist()
        cu.append(cu[-1] + n)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    slot_mapping[1::3] = -1
    contexts = [c for _, c in sequences]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), context_lens=torch.tensor(contexts, dtype=torch.int32),
        page_tables=tables, slot_mapping=slot_mapping, block_ids=torch.tensor(block_ids, dtype=torch.int32),
        max_seqlen_q=max(q for q, _ in sequences), max_context_len=tables.shape[1] * page_size,
        cu_seqlens_q_host=tuple(cu), context_lens_host=tuple(contexts))
    tokens = cu[-1]
    q = torch.randn(tokens, heads, head_dim, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=torch.float64, generator=gen) for _ in range(2))
    caches = [torch.randn(len(order) + sum(pages), page_size, kv_heads, head_dim, dtype=torch.float64,
                          generator=gen).to(cache_dtype) for _ in range(2)]
    return q, k, v, caches, meta


@pytest.mark.parametrize("heads, kv_heads", [(7, 1), (8, 2)])
def test_a_wide_group_s_cached_context_goes_to_the_paged_kernel_and_gives_the_paged_reference(heads, kv_heads):
    """flash-attn's paged call takes each row's cached context, the blocks kernel goes on over the in-forward keys:
    the same attention as the paged reference's over both, and the same cache written."""
    q, k, v, caches, meta = forward_over_a_context(heads, kv_heads, seed=heads)
    want_caches = [cache.clone() for cache in caches]
    want = paged_attention_reference(q, k, v, *want_caches, meta, 0.3)
    varlen = CountingReference()
    attention = FlashAttention(paged_attention_reference, varlen=varlen, store_kv=store_kv)
    got = attention(q, k, v, *caches, meta, 0.3)
    # flash-attn's lse is float32, which bounds the composition's agreement with float64's whole softmax.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(torch.equal(got_cache, want_cache) for got_cache, want_cache in zip(caches, want_caches))
    assert (varlen.paged_calls, varlen.dense_calls) == (1, 0)


@pytest.mark.parametrize("heads, kv_heads, cache_dtype", [(3, 1, torch.float64), (7, 1, torch.float32)],
                         ids=["narrow group", "cache of another dtype"])
def test_a_narrow_group_or_a_cache_flash_attn_cannot_read_goes_to_the_blocks_kernel_whole(heads, kv_heads,
                                                                                       cache_dtype):
    q, k, v, caches, meta = forward_over_a_context(heads, kv_heads, seed=1, cache_dtype=cache_dtype)
    calls = []

    def blocks(*args, **kwargs):
        calls.append(kwargs)
        return "blocks"

    attention = FlashAttention(blocks, varlen=CountingReference(), store_kv=store_kv)
    assert attention(q, k, v, *caches, meta, 0.3) == "blocks"
    assert calls == [{"kv_stored": False}] and attention.varlen.paged_calls == 0


def flash_engine(path: str, varlen: CountingReference, **overrides) -> Diffulex:
    """An engine whose attention is FlashAttention over the reference, with `varlen` for flash-attn, dense and paged:
    every group takes the paged call for its cached context (the tiny models' groups are narrower than Dream's)."""

    class DenseEngine(Diffulex):
        def _load_model(self, tp):
            model, lora_slots = super()._load_model(tp)
            attention = FlashAttention(paged_attention_reference, varlen=varlen, store_kv=store_kv,
                                       min_context_group=1)
            for layer in model.layers:
                layer.attn.attention_fn = attention
            return model, lora_slots

    return DenseEngine(path, **{**TINY_LIMITS, **overrides})


@pytest.mark.parametrize("family, strategy, settings", [
    ("llada", "multi_bd", dict(buffer_size=2)),
    ("llada", "vanilla", dict()),
    ("llada", "fast_dllm", dict()),
    ("dream", "d2f", dict()),
    ("sdar", "fast_dllm_v2", dict(sub_block_size=2)),
    ("llada", "dmax", dict()),
])
def test_an_engine_on_the_dense_path_decodes_the_tokens_of_the_paged_one(tiny_checkpoints, family, strategy,
                                                                          settings):
    prompts = ["the prompt of one request", "hi", "a third, longer prompt than the others, to chunk"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    settings = dict(decoding_strategy=strategy, **settings)
    want = run_requests(Diffulex(tiny_checkpoints[family], **{**TINY_LIMITS, **settings}), prompts, params)
    varlen = CountingReference()
    engine = flash_engine(tiny_checkpoints[family], varlen, **settings)
    got = run_requests(engine, prompts, params)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert varlen.dense_calls > 0  # the prompts' forwards took the dense path
    # The blocks' contexts took the paged one; vanilla feeds whole sequences, and caches nothing.
    assert (varlen.paged_calls > 0) == (strategy != "vanilla")
    assert engine.metrics().kv_pages_used == 0  # every page back in the pool


@pytest.fixture
def flash_attn_package(tmp_path, monkeypatch):
    """A `flash_attn` package of the test's making, first on the path, and no flash_attn module imported yet."""
    for name in [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "flash_attn").mkdir()
    return tmp_path / "flash_attn"


def test_a_flash_attn_package_that_fails_on_import_is_a_reason_not_an_error(flash_attn_package):
    # A flash-attn 2 built for another torch fails as its extension loads; `auto` then serves without it.
    (flash_attn_package / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    why = refusal((9, 0), torch.bfloat16, (128,), False)
    assert why == ("whose package flash-attn-4 (flash_attn.cute) cannot be imported (ImportError: undefined symbol: "
                   "_ZN3c10); see README, 'Attention backends'")
    assert not flash_attn_installed()
    with pytest.raises(ValueError, match="flash-attn cannot be imported: ImportError: undefined symbol"):
        FlashAttention(paged_attention_reference)


def test_flash_attn_without_its_cute_kernels_is_not_installed(flash_attn_package):
    (flash_attn_package / "__init__.py").write_text("")  # flash-attn 2 alone: no flash_attn.cute
    assert refusal((9, 0), torch.bfloat16, (128,), False).startswith(
        "whose package flash-attn-4 (flash_attn.cute) cannot be imported (ModuleNotFoundError: ")


def test_a_context_row_whose_lse_is_nan_or_minus_infinity_counts_as_having_seen_no_key():
    """The kernel starts such a row empty, whatever its output holds; so does the reference it is held to."""
    q, k, v, caches, meta = forward_over_a_context(7, 1, seed=5)
    meta = dataclasses.replace(meta, context_lens=torch.zeros_like(meta.context_lens),
                               context_lens_host=(0,) * meta.num_seqs)
    want = paged_attention_reference(q, k, v, None, None, meta, 0.3)  # the in-forward keys alone
    tokens = q.shape[0]
    lse = torch.full((7, tokens), float("-inf"), dtype=torch.float32)
    lse[:, ::2] = float("nan")
    garbage = torch.full_like(q, float("nan"))
    got = paged_attention_reference(q, k, v, None, None, meta, 0.3, prior=(garbage, lse))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
