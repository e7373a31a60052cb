"""The paged attention kernel computes exactly what the engine's torch reference computes."""
from __future__ import annotations

import dataclasses
import itertools

from dataclasses import dataclass

import pytest
import torch

import diffulex_kernels
from diffulex_kernels import attention as attention_kernels
from diffulex_kernels import fp8, kv_store
from diffulex_backend.attention import AttentionMetadata, context_attention_reference, paged_attention_reference
from diffulex_kernels.attention import (HEAD_DIMS, SHARED_MEMORY_BYTES, WIDE, AttentionLaunch, _merge_splits_kernel,
                                        _paged_attention_kernel, choose_num_splits, compile_launches, launch_variants,
                                        plan_launch, shared_memory_bytes)
from kernel_cases import DEVICE, FULL_SHAPES, REL_TOL, generator, poisoned_like, randn, relative_error

# Per sequence: (query tokens, cached context). A sequence may feed no query this step, contexts may be
# empty or end mid-page, and the longest context gives the split-KV path several chunks.
if FULL_SHAPES:
    SEQUENCES = [(32, 2048), (0, 700), (64, 517), (7, 0), (32, 1000), (96, 33)]
    HEAD_SHAPES = {1: (32, 32), 4: (32, 8), 7: (28, 4)}  # GQA group -> (heads, kv heads)
    BLOCK_LEN = 32
else:
    SEQUENCES = [(5, 37), (0, 20), (19, 0), (9, 150)]
    HEAD_SHAPES = {1: (2, 2), 4: (4, 1), 7: (7, 1)}
    BLOCK_LEN = 4


@dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def block_ids_for(pattern: str, context_len: int, query_len: int) -> list[int]:
    positions = range(context_len, context_len + query_len)
    if pattern == "causal":
        return list(positions)
    if pattern == "one_block":
        return [context_len] * query_len
    if pattern == "blocks":  # blocks in flight: bidirectional inside, causal across
        return [p // BLOCK_LEN * BLOCK_LEN for p in positions]
    if pattern == "zeros":
        return [0] * query_len
    raise ValueError(pattern)


def make_batch(
    *, heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, pattern: str, seed: int,
    sequences: list[tuple[int, int]] = SEQUENCES,
) -> Batch:
    gen = generator(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(q + c) // page_size) for q, c in sequences]
    num_pages = sum(pages_per_seq) + 3
    # Pages are handed out in a shuffled order, so page tables are not contiguous ranges.
    free_pages = torch.randperm(num_pages, generator=cpu_gen).tolist()
    max_pages = max(pages_per_seq)
    page_tables = torch.full((len(sequences), max_pages), -1, dtype=torch.int32)
    slots, block_ids = [], []
    for b, ((query_len, context_len), n_pages) in enumerate(zip(sequences, pages_per_seq)):
        page_tables[b, :n_pages] = torch.tensor([free_pages.pop() for _ in range(n_pages)], dtype=torch.int32)
        for pos in range(context_len, context_len + query_len):
            slots.append(int(page_tables[b, pos // page_size]) * page_size + pos % page_size)
        block_ids += block_ids_for(pattern, context_len, query_len)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    # Some tokens are not stored (blocks still in flight): every third one.
    slot_mapping[1::3] = -1
    cu = [0]
    for query_len, _ in sequences:
        cu.append(cu[-1] + query_len)
    num_tokens = cu[-1]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([c for _, c in sequences], dtype=torch.int32, device=DEVICE),
        page_tables=page_tables.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE),
        block_ids=torch.tensor(block_ids, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(q for q, _ in sequences),
        max_context_len=max(c for _, c in sequences),
        cu_seqlens_q_host=tuple(cu),
        context_lens_host=tuple(c for _, c in sequences),
    )
    return Batch(
        query=randn(num_tokens, heads, head_dim, dtype=dtype, gen=gen),
        key=randn(num_tokens, kv_heads, head_dim, dtype=dtype, gen=gen),
        value=randn(num_tokens, kv_heads, head_dim, dtype=dtype, gen=gen),
        k_cache=randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen),
        v_cache=randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen),
        meta=meta,
    )


def assert_matches_reference(batch: Batch, num_splits: int | None, launch: AttentionLaunch | None = None) -> None:
    head_dim = batch.query.shape[-1]
    scale = head_dim**-0.5
    k_cache_ref, v_cache_ref = batch.k_cache.clone(), batch.v_cache.clone()
    ref = paged_attention_reference(batch.query, batch.key, batch.value, k_cache_ref, v_cache_ref, batch.meta, scale)
    launch = launch or plan_launch(batch.query, batch.key, batch.meta, num_splits=num_splits)
    out = diffulex_kernels.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, scale,
        out=poisoned_like(batch.query), launch=launch,
    )
    assert torch.isfinite(out).all(), "the kernel left output rows unwritten"
    assert relative_error(out, ref) < REL_TOL[batch.query.dtype]
    # The in-forward K/V went to exactly the slots the reference wrote, and nowhere else.
    assert_same_cache(batch.k_cache, k_cache_ref)
    assert_same_cache(batch.v_cache, v_cache_ref)


def assert_same_cache(cache: torch.Tensor, ref: torch.Tensor) -> None:
    if cache.dtype != torch.uint8:
        assert torch.equal(cache, ref)
        return
    # FP8 rows: the same values as numbers (the CPU interpreter writes a negative value that rounds to zero as +0)
    # and the same scales.
    (values, scales), (ref_values, ref_scales) = kv_store.fp8_rows(cache), kv_store.fp8_rows(ref)
    assert torch.equal(values.float(), ref_values.float()) and torch.equal(scales, ref_scales)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_fp8_rows_match_the_reference_over_the_same_rows(group, head_dim, dtype, num_splits):
    """Over a cache of FP8 rows (kv_cache_dtype fp8) the kernel reads each row times its scale, as the reference
    does, and stores the in-forward K/V as the reference quantizes them."""
    heads, kv_heads = HEAD_SHAPES[group]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, dtype=dtype,
                       pattern="blocks", seed=head_dim + group)
    batch = dataclasses.replace(batch, k_cache=kv_store.pack_fp8_rows(batch.k_cache),
                                v_cache=kv_store.pack_fp8_rows(batch.v_cache))
    assert_matches_reference(batch, num_splits)


@pytest.mark.parametrize("launch", launch_variants(64, 2), ids=str)
def test_fp8_rows_match_the_reference_under_every_launch(launch):
    """Each launch reads FP8 rows its own way: tiles of up to 64 rows load the rows' scales a tile ahead, wider ones
    in the tile's iteration; tiles of up to 128 rows widen the values to float16 (with the query rescaled), the
    256-row tile to the query's own dot dtype; unsplit tiles of up to 32 rows take 128 keys."""
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=37)
    batch = dataclasses.replace(batch, k_cache=kv_store.pack_fp8_rows(batch.k_cache),
                                v_cache=kv_store.pack_fp8_rows(batch.v_cache))
    assert_matches_reference(batch, launch.num_splits, launch=launch)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
def test_fp8_rows_under_bfloat16_queries_past_float16_s_range_match_the_reference(num_splits):
    """Over FP8 rows a bfloat16 query multiplies in float16: a query of 2^17 (float16 ends at 65504) times keys of
    2^-17 gives ordinary scores, and must not overflow on its way there."""
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=31)
    up = 2.0**17
    query = (batch.query.float() * up).to(torch.bfloat16)
    assert query.float().abs().max() > 65504
    batch = dataclasses.replace(batch, query=query, key=(batch.key.float() / up).to(torch.bfloat16),
                                k_cache=kv_store.pack_fp8_rows(batch.k_cache.float() / up),
                                v_cache=kv_store.pack_fp8_rows(batch.v_cache))
    assert_matches_reference(batch, num_splits)


def sink_batch(seed: int, ignored_value: float | None = None) -> Batch:
    """FP8 rows of values near 0.1 (float16 queries that lean on dimension 0) behind a sink: each sequence's first
    cached key, 10 nats above a typical key. With `ignored_value`, the next cached key points away from every query,
    and its value row holds that value."""
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.float16,
                       pattern="blocks", seed=seed, sequences=[(4, 2048), (3, 700)])
    query = batch.query.clone()
    query[..., 0] += 3  # every query leans on dimension 0
    k_cache, v_cache = batch.k_cache.clone(), 0.1 + batch.v_cache * 0.02
    for seq in range(len(batch.meta.context_lens_host)):
        page = int(batch.meta.page_tables[seq, 0])
        k_cache[page, 0].zero_()
        k_cache[page, 0, ..., 0] = 27
        if ignored_value is not None:
            k_cache[page, 1].zero_()
            k_cache[page, 1, ..., 0] = -27
            v_cache[page, 1] = ignored_value
    return dataclasses.replace(batch, query=query, k_cache=kv_store.pack_fp8_rows(k_cache),
                               v_cache=kv_store.pack_fp8_rows(v_cache), value=0.1 + batch.value * 0.02)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
def test_fp8_rows_of_small_values_behind_a_sink_keep_float16_s_precision(num_splits):
    """float16's narrow exponent: a value row's scale (max|v| / 448, about 4e-4 for values near 0.1) times the
    probability of a key 10 nats under the sink's (about 5e-5) is below float16's smallest step if the two are
    multiplied before the product with V, and the thousands of weak keys, a tenth of the mass, would be lost."""
    assert_matches_reference(sink_batch(seed=29), num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
def test_fp8_rows_of_small_values_after_a_far_larger_ignored_row_keep_float16_s_precision(num_splits):
    """The weights over FP8 rows are relative to the largest value scale so far in the context: a value row 4000
    times the others, which no query attends to, raises it for every key after it. The weak keys behind a sink (a
    tenth of the mass, about 5e-5 each) then weigh about 1e-8 relative to it, below float16's smallest step unless
    the weights are scaled up to float16's top."""
    assert_matches_reference(sink_batch(seed=43, ignored_value=400.0), num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
def test_fp8_rows_whose_value_scales_rise_and_fall_along_the_context_match_the_reference(num_splits):
    """Over FP8 rows the product with V accumulates in units of the largest value scale so far: each key tile whose
    rows are larger rescales what came before, and rows far smaller than an earlier one still count. The value
    rows' magnitudes here climb by 2^12 over the first half of each context and fall back over the second; one
    sequence's cached values are all zero."""
    heads, kv_heads = HEAD_SHAPES[1]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=41, sequences=[*SEQUENCES, (4, 300)])
    v_cache = batch.v_cache.float().clone()
    page_size = v_cache.shape[1]
    for seq, context in enumerate(batch.meta.context_lens_host):
        for pos in range(context):
            page, slot = int(batch.meta.page_tables[seq, pos // page_size]), pos % page_size
            v_cache[page, slot] *= 2.0 ** (12 * (1 - abs(2 * pos / max(1, context - 1) - 1)) - 6)
    contexts, cu = batch.meta.context_lens_host, batch.meta.cu_seqlens_q_host
    zeroed = min((seq for seq, context in enumerate(contexts) if context and cu[seq + 1] > cu[seq]),
                 key=lambda seq: contexts[seq])
    for pos in range(contexts[zeroed]):
        v_cache[int(batch.meta.page_tables[zeroed, pos // page_size]), pos % page_size] = 0
    batch = dataclasses.replace(batch, k_cache=kv_store.pack_fp8_rows(batch.k_cache),
                                v_cache=kv_store.pack_fp8_rows(v_cache))
    for launch in (None, AttentionLaunch(32, 128, num_splits, 4, 2), AttentionLaunch(128, 64, num_splits, 8, 2)):
        assert_matches_reference(dataclasses.replace(batch, k_cache=batch.k_cache.clone(),
                                                     v_cache=batch.v_cache.clone()), num_splits, launch=launch)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_matches_reference_across_shapes(page_size, head_dim, group, num_splits):
    heads, kv_heads = HEAD_SHAPES[group]
    batch = make_batch(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, dtype=torch.bfloat16,
        pattern="blocks", seed=page_size * 1000 + head_dim * 10 + group,
    )
    assert_matches_reference(batch, num_splits)


@pytest.mark.parametrize("pattern", ["causal", "one_block", "blocks", "zeros"])
def test_block_mask_patterns_match_reference(pattern):
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16, pattern=pattern, seed=7)
    assert_matches_reference(batch, num_splits=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_input_dtypes_match_reference(dtype):
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=128, page_size=32, dtype=dtype, pattern="causal", seed=11)
    assert_matches_reference(batch, num_splits=2)


def test_automatic_split_choice_matches_reference():
    heads, kv_heads = HEAD_SHAPES[1]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=32, dtype=torch.bfloat16, pattern="blocks", seed=5)
    assert_matches_reference(batch, num_splits=None)


def test_splits_share_each_real_context_under_a_loose_bound():
    # A CUDA graph bucket sizes the grid for max_model_len; every sequence's shorter real context is still cut
    # among all the splits, and the result is the same.
    heads, kv_heads = HEAD_SHAPES[1]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=9)
    batch.meta = dataclasses.replace(batch.meta, max_context_len=4 * batch.meta.max_context_len)
    assert_matches_reference(batch, num_splits=5)


def test_without_cache_attends_in_forward_only():
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(
        heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16, pattern="causal", seed=3,
        sequences=[(q, 0) for q, _ in SEQUENCES],
    )
    scale = 0.125
    ref = paged_attention_reference(batch.query, batch.key, batch.value, None, None, batch.meta, scale)
    out = diffulex_kernels.paged_attention(
        batch.query, batch.key, batch.value, None, None, batch.meta, scale, out=poisoned_like(batch.query)
    )
    assert relative_error(out, ref) < REL_TOL[torch.bfloat16]


def test_split_kv_is_chosen_for_long_context_at_small_batch_only():
    # LLaDA-8B at batch 1: one 32-token tile per kv head, 32 programs of 4 warps for 132 multiprocessors.
    assert choose_num_splits(base_programs=32, max_context_len=2048, num_sms=132, num_warps=4) == 8
    # Dream-7B at batch 4: two 128-row tiles per kv head, 32 programs of 8 warps: one program per multiprocessor.
    assert choose_num_splits(base_programs=32, max_context_len=2048, num_sms=132, num_warps=8) == 4
    # Batch 8 already launches 256 programs; short contexts are not worth a merge pass.
    assert choose_num_splits(base_programs=256, max_context_len=2048, num_sms=132, num_warps=4) == 1
    assert choose_num_splits(base_programs=32, max_context_len=100, num_sms=132, num_warps=4) == 1


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
def test_256_row_tiles_match_reference(num_splits):
    # The tile plan_launch gives a wide GQA group at large batch, forced here at any batch.
    heads, kv_heads = HEAD_SHAPES[7]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=128, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=13)
    assert_matches_reference(batch, num_splits, launch=AttentionLaunch(256, 64, num_splits, 8, 3))


def test_wide_gqa_group_takes_one_256_row_tile_unless_split():
    # Dream-7B's group of 7 heads over a 32-token block is 224 rows: one tile, so each K/V tile is read once.
    # Planned on the CPU, whose one "multiprocessor" every batch fills.
    query, key = torch.empty(32, 28, 128, dtype=torch.bfloat16), torch.empty(32, 4, 128, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 32], dtype=torch.int32), context_lens=torch.tensor([512], dtype=torch.int32),
        page_tables=torch.zeros(1, 34, dtype=torch.int32), slot_mapping=torch.zeros(32, dtype=torch.int64),
        block_ids=torch.zeros(32, dtype=torch.int32), max_seqlen_q=32, max_context_len=512,
    )
    assert plan_launch(query, key, meta).block_m == 256
    assert plan_launch(query, key, meta, num_splits=1).block_m == 256
    split = plan_launch(query, key, meta, num_splits=4)
    assert (split.block_m, split.num_splits, split.num_warps) == (128, 4, 8)
    # float32 multiplies on the FMA units, in small tiles (kernels/attention.py, TileLimits).
    assert plan_launch(query.float(), key.float(), meta).block_m == 16


def test_tiles_of_up_to_32_rows_take_128_keys_split_or_not():
    """A key tile's fixed cost (the accumulator's rescale, the row reductions) takes 128 keys to cover where a
    program has up to 32 rows (LLaDA's 32-token block of one head, or a 16-token block), unsplit or split, in both
    half types and at head sizes 64 and 128. Wider tiles keep 64."""
    def plan(heads: int, kv_heads: int, num_splits: int, head_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, tokens: int = 32) -> AttentionLaunch:
        query = torch.empty(tokens, heads, head_dim, dtype=dtype)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
            context_lens=torch.tensor([4096], dtype=torch.int32), page_tables=torch.zeros(1, 130, dtype=torch.int32),
            slot_mapping=torch.zeros(tokens, dtype=torch.int64), block_ids=torch.zeros(tokens, dtype=torch.int32),
            max_seqlen_q=tokens, max_context_len=4096)
        return plan_launch(query, torch.empty(tokens, kv_heads, head_dim, dtype=dtype), meta, num_splits=num_splits)

    shape = lambda launch: (launch.block_m, launch.block_n, launch.num_warps)  # noqa: E731
    assert shape(plan(32, 32, 1)) == (32, 128, 4)
    assert shape(plan(32, 32, 1, dtype=torch.float16)) == (32, 128, 4)
    assert shape(plan(32, 32, 1, head_dim=64)) == (32, 128, 4)
    assert shape(plan(32, 32, 1, tokens=16)) == (16, 128, 4)  # a 16-token block: 16-row tiles
    assert shape(plan(32, 32, 4, tokens=16)) == (16, 128, 4)
    assert shape(plan(32, 32, 4)) == (32, 128, 4)
    assert shape(plan(32, 32, 4, head_dim=64)) == (32, 128, 4)
    assert shape(plan(64, 32, 1)) == (64, 64, 4)
    assert shape(plan(32, 32, 1, head_dim=256)) == (32, 32, 8)  # Gemma's wide heads: no longer tiles
    assert shape(plan(28, 7, 1)) == (128, 64, 4)
    assert shape(plan(28, 7, 4)) == (128, 64, 8)
    assert shape(plan(32, 32, 1, dtype=torch.float32)) == (16, 32, 4)  # float32: the FMA units' small tiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_launch_fits_an_h100_s_shared_memory(dtype, head_dim):
    """A launch whose tiles outgrow shared memory fails on the GPU alone, when the engine starts; the bound is
    checked here for every launch the runner compiles, in every dtype it serves."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    for launch in launch_variants(head_dim, element_size):
        assert shared_memory_bytes(launch, head_dim, element_size) <= SHARED_MEMORY_BYTES, launch
    # The 256-row tile serves half types up to head size 128 (in float32 at 128 it needed 328,192 bytes).
    assert (WIDE in launch_variants(head_dim, element_size)) == (element_size < 4 and head_dim <= 128)


def test_a_sequence_with_dropped_pages_reads_its_kept_pages_only():
    """Page retention's metadata (forward_batch.py): the kept pages packed, the context shortened by the dropped
    ones. The dropped pages hold infinities: one read of them would poison the output. The kernel equals the reference
    over the same metadata, and the reference equals attention over the kept keys alone (tests/unit)."""
    import numpy as np

    from diffulex_backend.forward_batch import build_forward_batch
    from diffulex_backend.plan import RequestSampling, SeqPlan
    from diffulex_backend.sampling import Confidence

    page_size, heads, kv_heads, head_dim = 16, 4, 2, 64
    gen = generator(5)
    k_cache = randn(12, page_size, kv_heads, head_dim, dtype=torch.float32, gen=gen)
    v_cache = randn(12, page_size, kv_heads, head_dim, dtype=torch.float32, gen=gen)
    table = [7, -1, 2, -1, -1, 9, 4]  # 7 logical pages, 3 dropped; 100 cached tokens, 12 in the last page
    for dropped in (3, 1, 0):  # pages the table no longer holds: poisoned, and physical page 0 too
        k_cache[dropped], v_cache[dropped] = float("inf"), float("inf")
    sampling = RequestSampling(seed=0, temperature=0.0, top_k=0, top_p=1.0, confidence_kind=Confidence.PROB,
                               accept_threshold=0.9, remask_threshold=0.0)
    tokens = 8
    plan = SeqPlan(request_id="0", start=100, end=100 + tokens, context_len=100,
                   token_ids=np.zeros(tokens, dtype=np.int64), cache_index=np.full(tokens, -1, dtype=np.int64),
                   block_ids=np.full(tokens, 100, dtype=np.int32), blocks=[], page_table=table, committed_end=100,
                   step=0, sampling=sampling, num_dropped_pages=3)
    _, _, meta = build_forward_batch([plan], page_size, 128, pin_memory=False).to_device(DEVICE)
    assert meta.context_lens_host == (100 - 3 * page_size,)
    assert meta.page_tables[0, :4].tolist() == [7, 2, 9, 4]
    batch = Batch(query=randn(tokens, heads, head_dim, dtype=torch.float32, gen=gen),
                  key=randn(tokens, kv_heads, head_dim, dtype=torch.float32, gen=gen),
                  value=randn(tokens, kv_heads, head_dim, dtype=torch.float32, gen=gen),
                  k_cache=k_cache, v_cache=v_cache, meta=meta)
    assert_matches_reference(batch, num_splits=None)
    assert_matches_reference(batch, num_splits=2)


def test_every_launch_plan_launch_picks_is_one_the_runner_compiles_ahead():
    """The runner compiles `launch_variants()` when it is built; a launch outside them would compile while
    requests wait. Split counts stand for one another: the kernel takes the count at run time."""
    for dtype, head_dim, (heads, kv_heads) in itertools.product(
            [torch.bfloat16, torch.float32], HEAD_DIMS, [(1, 1), (4, 1), (7, 1), (32, 8), (28, 4)]):
        variants = set(launch_variants(head_dim, torch.empty(0, dtype=dtype).element_size()))
        for tokens in [1, 2, 5, 16, 17, 31, 33, 64, 65, 129, 300]:
            query = torch.empty(tokens, heads, head_dim, dtype=dtype)
            key = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
            meta = AttentionMetadata(
                cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
                context_lens=torch.tensor([4096], dtype=torch.int32), page_tables=torch.zeros(1, 256, dtype=torch.int32),
                slot_mapping=torch.zeros(tokens, dtype=torch.int64), block_ids=torch.zeros(tokens, dtype=torch.int32),
                max_seqlen_q=tokens, max_context_len=4096)
            for num_splits in [None, 1, 2, 5, 64]:
                launch = plan_launch(query, key, meta, num_splits=num_splits)
                normalised = dataclasses.replace(launch, num_splits=min(launch.num_splits, 2))
                assert normalised in variants, (heads, kv_heads, tokens, num_splits, launch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_compiling_every_launch_ahead_runs_each_one(head_dim, dtype):
    compile_launches(num_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=16, dtype=dtype,
                     device=torch.device(DEVICE))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiling_the_launches_over_fp8_rows_ahead_runs_each_one(head_dim):
    compile_launches(num_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=16, dtype=torch.bfloat16,
                     device=torch.device(DEVICE), kv_fp8=True)


def test_compiling_the_merges_that_cast_for_an_fp8_o_proj_ahead_runs_each_one():
    compile_launches(num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16,
                     device=torch.device(DEVICE), fp8_out=True)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [1, 7])
def test_the_output_cast_for_an_fp8_o_proj_is_the_output_quantize_rows_casts_bit_for_bit(group, dtype, num_splits,
                                                                                        monkeypatch):
    """With fp8_out each token's heads come as one row cast to fp8 with its scale, the values and scales that
    `quantize_rows` gives of the float output, bit for bit: split, the merge casts them itself (no quantize_rows
    launch), over every head of the token (7 heads: a tile of 8 with one past the last); unsplit, quantize_rows
    casts the output."""
    heads, kv_heads = HEAD_SHAPES[group]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=dtype, pattern="blocks",
                       seed=41 + group)
    launch = plan_launch(batch.query, batch.key, batch.meta, num_splits=num_splits)
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    out = diffulex_kernels.paged_attention(*args, launch=launch)
    want_q, want_scale = fp8.quantize_rows(out.reshape(out.shape[0], -1))
    casts = []
    monkeypatch.setattr(attention_kernels, "quantize_rows", lambda x: casts.append(x) or fp8.quantize_rows(x))
    q, scale = diffulex_kernels.paged_attention(*args, launch=launch, fp8_out=True, kv_stored=True)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (out.shape[0], heads * 64)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert len(casts) == (1 if num_splits == 1 else 0)


def test_rows_wider_than_the_merge_casts_take_quantize_rows_and_come_out_alike(monkeypatch):
    """A token's heads wider than MAX_FP8_MERGE_VALUES are merged as floats and cast by quantize_rows, to the same
    values."""
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=43)
    launch = plan_launch(batch.query, batch.key, batch.meta, num_splits=3)
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    merged = diffulex_kernels.paged_attention(*args, launch=launch, fp8_out=True)
    monkeypatch.setattr(attention_kernels, "MAX_FP8_MERGE_VALUES", heads * 64 - 1)
    casts = []
    monkeypatch.setattr(attention_kernels, "quantize_rows", lambda x: casts.append(x) or fp8.quantize_rows(x))
    cast = diffulex_kernels.paged_attention(*args, launch=launch, fp8_out=True, kv_stored=True)
    assert len(casts) == 1
    assert torch.equal(merged[0].view(torch.uint8), cast[0].view(torch.uint8)) and torch.equal(merged[1], cast[1])


def test_no_tokens_give_no_fp8_rows():
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=44, sequences=[(0, 20)])
    q, scale = diffulex_kernels.paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                                                batch.meta, 0.125, fp8_out=True)
    assert q.shape == (0, heads * 64) and q.dtype == torch.float8_e4m3fn and scale.shape == (0,)


@pytest.mark.parametrize("window", [6, 512])
def test_compiling_a_windowed_layer_s_launches_ahead_runs_each_one(window):
    compile_launches(num_heads=4, num_kv_heads=2, head_dim=256, page_size=16, dtype=torch.bfloat16,
                     device=torch.device(DEVICE), window=window)


def strided_caches(batch: Batch, columns_before: int) -> Batch:
    """The batch's caches as column views of wider rows, as DiffusionGemma's per-layer caches are (one cache row
    holds every layer's K or V): the kernel reads them through their strides."""
    pages, page_size, kv_heads, head_dim = batch.k_cache.shape

    def widen(cache: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(pages, page_size, columns_before + kv_heads * head_dim + 8, dtype=cache.dtype,
                           device=cache.device)
        view = rows[:, :, columns_before:columns_before + kv_heads * head_dim].unflatten(-1, (kv_heads, head_dim))
        view.copy_(cache)
        return view

    return dataclasses.replace(batch, k_cache=widen(batch.k_cache), v_cache=widen(batch.v_cache))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("window", [1, 6, 40, 100, 130, 100_000])
def test_a_sliding_window_matches_diffusion_gemma_s_attention_and_reads_no_page_outside_it(window, num_splits):
    """DiffusionGemma's sliding layers: the kernel against the model's torch attention (scale 1, strided caches).
    Every page wholly before a sequence's window holds NaN: a single read of one would poison the output. Windows
    wider than a key tile cut the window's part of a longer context into splits (100 and 130 over a 150-token one)."""
    from diffulex_backend.models.diffusion_gemma import window_attention

    heads, kv_heads = HEAD_SHAPES[4]
    batch = strided_caches(make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                                      pattern="blocks", seed=window + num_splits), columns_before=64)
    batch.query = batch.query * 64**-0.5  # scale 1, as Gemma's normed queries take it, at a moderate temperature
    page_size = batch.k_cache.shape[1]
    for seq, context_len in enumerate(batch.meta.context_lens_host):
        first = max(0, context_len - window + 1)
        for logical in range(first // page_size):
            page = int(batch.meta.page_tables[seq, logical])
            batch.k_cache[page], batch.v_cache[page] = float("nan"), float("nan")
    k_cache_ref, v_cache_ref = batch.k_cache.clone(), batch.v_cache.clone()
    ref = window_attention(batch.query, batch.key, batch.value, k_cache_ref, v_cache_ref, batch.meta, window)
    out = diffulex_kernels.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, 1.0,
        out=poisoned_like(batch.query), window=window,
        launch=plan_launch(batch.query, batch.key, batch.meta, num_splits=num_splits))
    assert torch.isfinite(out).all(), "the kernel read a page outside the window, or left rows unwritten"
    assert relative_error(out, ref) < REL_TOL[torch.bfloat16]
    assert torch.equal(batch.k_cache.nan_to_num(), k_cache_ref.nan_to_num())


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("head_dim", [256, 512])
def test_gemma_s_wide_heads_match_reference(head_dim, num_splits):
    heads, kv_heads = HEAD_SHAPES[4]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=head_dim + num_splits)
    launch = plan_launch(batch.query, batch.key, batch.meta, num_splits=num_splits)
    assert launch in {dataclasses.replace(v, num_splits=launch.num_splits)
                      for v in launch_variants(head_dim, batch.query.element_size())}
    assert_matches_reference(batch, num_splits)


def test_a_window_below_one_is_refused():
    heads, kv_heads = HEAD_SHAPES[1]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=1)
    with pytest.raises(ValueError, match=r"^paged_attention: window must be at least 1, got 0$"):
        diffulex_kernels.paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                                         batch.meta, 1.0, window=0)


@pytest.mark.parametrize("pattern, group, head_dim, dtype", [
    ("one_block", 1, 128, torch.bfloat16), ("blocks", 1, 128, torch.bfloat16), ("causal", 1, 128, torch.bfloat16),
    ("one_block", 7, 128, torch.bfloat16), ("blocks", 7, 128, torch.bfloat16), ("causal", 7, 128, torch.bfloat16),
    ("blocks", 7, 64, torch.float16), ("blocks", 4, 64, torch.float32),
], ids=str)
def test_a_prior_over_the_context_and_the_in_forward_keys_give_the_attention_over_both(pattern, group, head_dim,
                                                                                      dtype):
    """flash-attn computes a block's attention over its cached context (out and lse); the kernel goes on from it over
    the in-forward keys under the block mask. Together they give the attention over the whole, with every sequence
    kind of the batch: no query, no context, a context that ends mid-page."""
    heads, kv_heads = HEAD_SHAPES[group]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, dtype=dtype,
                       pattern=pattern, seed=40 + group)
    scale = head_dim ** -0.5
    k_cache_ref, v_cache_ref = batch.k_cache.clone(), batch.v_cache.clone()
    ref = paged_attention_reference(batch.query, batch.key, batch.value, k_cache_ref, v_cache_ref, batch.meta, scale)
    meta = batch.meta  # the reference stored the in-forward K/V, as the engine's RoPE launch does before both
    prior = context_attention_reference(batch.query, k_cache_ref, v_cache_ref, meta.cu_seqlens_q, meta.context_lens,
                                        meta.page_tables, scale)
    out = diffulex_kernels.paged_attention(batch.query, batch.key, batch.value, None, None, meta, scale,
                                           out=poisoned_like(batch.query), prior=prior)
    assert torch.isfinite(out).all(), "the kernel left output rows unwritten"
    assert relative_error(out, ref) < REL_TOL[dtype]
    # The torch reference composes the same way.
    composed = paged_attention_reference(batch.query, batch.key, batch.value, None, None, meta, scale, prior=prior)
    assert relative_error(composed, ref) < REL_TOL[dtype]


def test_a_prior_row_whose_lse_is_nan_or_minus_infinity_starts_empty_whatever_its_output():
    heads, kv_heads = HEAD_SHAPES[7]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=8, sequences=[(q, 0) for q, _ in SEQUENCES])
    tokens = batch.query.shape[0]
    lse = torch.full((heads, tokens), float("-inf"), dtype=torch.float32, device=DEVICE)
    lse[:, ::2] = float("nan")
    garbage = torch.full_like(batch.query, float("nan"))
    args = (batch.query, batch.key, batch.value, None, None, batch.meta, 0.125)
    want = diffulex_kernels.paged_attention(*args)  # the in-forward keys alone
    got = diffulex_kernels.paged_attention(*args, out=poisoned_like(batch.query), prior=(garbage, lse))
    assert torch.isfinite(got).all() and relative_error(got, want) < 1e-3


def test_a_prior_with_a_cache_or_of_another_shape_is_refused():
    heads, kv_heads = HEAD_SHAPES[7]
    batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=64, page_size=16, dtype=torch.bfloat16,
                       pattern="blocks", seed=3)
    tokens = batch.query.shape[0]
    prior = (torch.zeros_like(batch.query), torch.zeros(heads, tokens, dtype=torch.float32, device=DEVICE))
    args = (batch.query, batch.key, batch.value)
    with pytest.raises(ValueError, match="a prior stands for the cached context"):
        diffulex_kernels.paged_attention(*args, batch.k_cache, batch.v_cache, batch.meta, 1.0, prior=prior)
    with pytest.raises(ValueError, match=rf"prior must be \(out .*lse \({heads}, {tokens}\) float32\)"):
        diffulex_kernels.paged_attention(*args, None, None, batch.meta, 1.0, prior=(prior[0], prior[1][:, :-1]))


def test_compiling_the_launches_that_go_on_from_a_prior_ahead_runs_each_one():
    compile_launches(num_heads=7, num_kv_heads=1, head_dim=64, page_size=16, dtype=torch.bfloat16,
                     device=torch.device(DEVICE), prior=True)


def compiled_kernels() -> int:
    return sum(len(caches[0]) for kernel in (_paged_attention_kernel, _merge_splits_kernel)
               for caches in kernel.device_caches.values())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="counts compiled GPU kernels; the interpreter compiles none")
def test_the_launches_compiled_ahead_are_those_an_engine_s_batches_take():
    """After compile_launches, batches of any token count over page tables as wide as an engine's (max_model_len's
    pages), with a cache, and going on from a prior, compile nothing more: no request waits on a compile."""
    heads, kv_heads, page_size, columns = 28, 4, 16, 140
    for prior in (False, True):
        compile_launches(heads, kv_heads, 128, page_size, torch.bfloat16, torch.device(DEVICE), prior=prior)
    compiled = compiled_kernels()
    for seed, sequences in enumerate(([(32, 700), (32, 40)], [(33, 100)], [(1, 2000)])):
        batch = make_batch(heads=heads, kv_heads=kv_heads, head_dim=128, page_size=page_size, dtype=torch.bfloat16,
                           pattern="blocks", seed=seed, sequences=sequences)
        tables = torch.full((len(sequences), columns), -1, dtype=torch.int32, device=DEVICE)
        tables[:, :batch.meta.page_tables.shape[1]] = batch.meta.page_tables
        meta = dataclasses.replace(batch.meta, page_tables=tables, max_context_len=columns * page_size)
        args = (batch.query, batch.key, batch.value)
        diffulex_kernels.paged_attention(*args, batch.k_cache, batch.v_cache, meta, 0.1)
        prior = context_attention_reference(batch.query, batch.k_cache, batch.v_cache, meta.cu_seqlens_q,
                                            meta.context_lens, meta.page_tables, 0.1)
        diffulex_kernels.paged_attention(*args, None, None, meta, 0.1, prior=prior)
    assert compiled_kernels() == compiled
