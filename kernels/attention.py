"""Paged attention for diffusion blocks over a varlen batch: the kernel twin of
`diffulex_backend.attention.paged_attention_reference`, with the same metadata and semantics.

One program owns a tile of query rows of one sequence and one kv head. A row is a (token, head) pair of
that kv head's GQA group, flattened token-major, so each K/V tile read from the cache serves every query head
of the group. The program streams the sequence's cached context `[0, context_len)` through the page table,
all visible, then the in-forward keys of the sequence under the block mask (`block_ids[key] <= block_ids[query]`),
with an online softmax in float32 (base 2: the scale carries log2(e)).

A sliding window (DiffusionGemma's sliding layers) hides from a query of block id b every key at a position at or
before b - window. Every row's block id is at least the sequence's context length, so the program starts its context
loop at context_len - window + 1: pages wholly outside the window are never read.

Head sizes up to 128 take tiles of up to 128 rows by 64 keys (128 keys for a tile of up to 32 rows, split or not); 256
and 512 (Gemma's two) take narrower tiles, so that a program's accumulator stays in registers and its K/V buffers in
shared memory.

A prior (`paged_attention(prior=...)`) stands for the context: each row's attention over it, computed by another
kernel (flash-attn's paged one) as an output and a log-sum-exp, which the program takes as its starting state
before the in-forward keys.

Split-KV: when (q tiles x sequences x kv heads) cannot fill the GPU and contexts are long, the cached context
is cut into `num_splits` chunks, each program writes an unnormalised partial (acc, max, sum) per row, and a
second kernel merges the partials. Split 0 also takes the in-forward keys. The number of splits depends only on
host integers (`max_seqlen_q`, `max_context_len`, shapes), so a CUDA graph captured for a bucket stays valid:
the kernels read the real lengths from device memory, and cut each sequence's real context into that many
chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import triton
import triton.language as tl

from .device import multiprocessor_count
from .dtypes import dot_dtype, triton_dtype
from .fp8 import FP8, quantize_rows
from .fp8_cast import abs_max, cast_to_fp8_range, nan_max, row_scale
from .kv_store import fp8_row_bytes, store_kv, typed_caches
from .pdl import use_pdl, wait_for_previous_kernel

LOG2_E = 1.4426950408889634
# Below this many cached tokens per split, another split costs more (its partial round trip) than it saves.
MIN_SPLIT_CHUNK = 128
MAX_SPLITS = 64  # the merge holds every split of a row in registers
HEAD_DIMS = (64, 128, 256, 512)  # the head sizes the kernel is built and tested for
# Shared memory one program of an H100 may hold (227 KiB); a launch whose tiles need more fails before it runs.
SHARED_MEMORY_BYTES = 232448
# Over FP8 rows a weight is a probability times its value row's scale over the largest scale so far, times this:
# at most 2^15, under float16's largest value (65504), and the weak keys' weights after a far larger row (a value
# row 4000 times the others, say) stay in float16's normal range rather than rounding to 0.
_FP8_WEIGHT_TOP = tl.constexpr(2.0**15)
_LOG2_E = tl.constexpr(LOG2_E)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, v_unit, qk, v, visible, v_scale, PRECISION: tl.constexpr,
                         ROW_SCALES: tl.constexpr):
    """Fold one key tile's scores qk [BLOCK_M, BLOCK_N] (in log2 units) into the running (acc, max, sum);
    v: [BLOCK_N, HEAD_DIM]; visible: [BLOCK_M, BLOCK_N].

    With ROW_SCALES, v holds FP8 rows' values (exact in v's dtype) and v_scale [BLOCK_N] each value row's scale, which
    multiplies its column of probabilities once: BLOCK_M products a row where scaling the rows themselves would take
    HEAD_DIM, and a float32 round trip of every cached element besides. acc is then in units of v_unit / 2^15, where
    v_unit is the largest value scale so far, so that every weight is within 2^15 and float16 holds it (a
    probability times a raw scale of ~1e-4 would fall below float16's normal range); a larger scale rescales acc with
    alpha, as a larger score does, and the product accumulates in place. The caller multiplies acc by
    v_unit / 2^15 after its last tile of FP8 rows."""
    qk = tl.where(visible, qk, float("-inf"))
    # m_i starts finite (-1e30), so a tile with no visible key leaves alpha = 1 and adds nothing.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if ROW_SCALES:
        v_unit_new = tl.maximum(v_unit, tl.max(v_scale, 0))
        weights = p * (v_scale * (_FP8_WEIGHT_TOP / v_unit_new))[None, :]
        acc = acc * (alpha * (v_unit / v_unit_new))[:, None]
        acc = tl.dot(weights.to(v.dtype), v, acc, input_precision=PRECISION)
        v_unit = v_unit_new
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i, v_unit


@triton.jit
def _widen_e4m3(x, dtype: tl.constexpr, IN_PTX: tl.constexpr):
    """float8_e4m3fn values in `dtype`, exactly. With IN_PTX (a GPU, `dtype` float16) the conversion is inline PTX
    that the compiler treats as having effects, so it stays before the tile's change to the tensor cores' operand
    layout. A plain cast may be moved after that change, and a value tile then crosses shared memory as bytes: the
    product with V takes it as its transposed operand, whose layout wants four keys of one column a thread, four
    bytes a row apart, so each is a load of its own. Widened first, the tile crosses as float16, which ldmatrix loads
    transposed. The key tile is the scores' untransposed operand, which loads in words either way."""
    if IN_PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return x.to(dtype)


@triton.jit
def _row_scales(page_row, k_scale_ptr, v_scale_ptr, pos, ctx_end, kv_head, stride_scale_page, stride_scale_slot,
                stride_scale_head, PAGE_SIZE: tl.constexpr):
    """The key and value rows' scales at cached positions `pos` [BLOCK_N]; 0 at or past ctx_end."""
    valid = pos < ctx_end
    page = tl.load(page_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    offset = page * stride_scale_page + (pos % PAGE_SIZE) * stride_scale_slot + kv_head * stride_scale_head
    return (tl.load(k_scale_ptr + offset, mask=valid, other=0.0),
            tl.load(v_scale_ptr + offset, mask=valid, other=0.0))


# What varies with a batch is not specialized on (each new length class would compile again), so that the launches
# compiled ahead (`compile_launches`, over one token and a page table of one column) are the ones every batch
# takes: the token count, the splits, the window, the page table's row stride (its columns) and the prior lse's
# head stride (the token count).
@triton.jit(do_not_specialize=["num_tokens", "num_splits", "window", "stride_page_table", "stride_lse_h"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, page_tables_ptr, block_ids_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, prior_out_ptr, prior_lse_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_prior_t, stride_prior_h, stride_lse_h, stride_lse_t,
    stride_cache_page, stride_cache_slot, stride_cache_head, stride_page_table,
    stride_scale_page, stride_scale_slot, stride_scale_head,
    num_kv_heads, num_tokens, num_heads, num_splits, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_CACHE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr, FP8_DOT_DTYPE: tl.constexpr, RESCALE_Q: tl.constexpr,
    SCALES_AHEAD: tl.constexpr, WIDEN_IN_PTX: tl.constexpr, PRECISION: tl.constexpr, HAS_PRIOR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    tile = tl.program_id(0)
    seq = tl.program_id(1) // num_kv_heads
    kv_head = tl.program_id(1) % num_kv_heads
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP  # [BLOCK_M] token index inside the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_valid = token < q_len
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q_in = tl.load(q_rows, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q = q_in.to(DOT_DTYPE)
    q_block = tl.load(block_ids_ptr + q_start + token, mask=row_valid, other=0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Over FP8 rows acc is in units of v_unit / 2^15 until the context loop ends (_online_softmax_step). The start
    # is below any row's scale (an all-zero row's is 1e-12 / 448) and above float32's smallest normal, which keeps
    # it a float32 scalar.
    v_unit = 1.0e-30
    keys = tl.arange(0, BLOCK_N)
    # The first position any row may see: a key at or before q_block - window is outside the row's window.
    window_edge = q_block - window

    context_len = 0
    if HAS_CACHE:
        if RESCALE_Q:
            # FP8 rows widen to float16 in one conversion per pair of values, where bfloat16 takes three; a bfloat16
            # query goes to float16 too, each row over a power of two that puts its largest value near 2^8, so that
            # no query overflows float16 and each keeps every bit but of values under 2^-22 of its row's largest.
            # q_unit multiplies the row's scores back.
            q_amax = tl.maximum(tl.max(tl.abs(q_in.to(tl.float32)), 1), 1e-30)
            q_unit = tl.exp2(tl.ceil(tl.log2(q_amax)) - 8.0)
            q_fp8_dot = (q_in.to(tl.float32) / q_unit[:, None]).to(FP8_DOT_DTYPE)
        context_len = tl.load(context_lens_ptr + seq)
        ctx_first = 0
        if HAS_WINDOW:
            ctx_first = tl.maximum(context_len - window + 1, 0)
        # This sequence's own context in num_splits chunks of whole key tiles. The grid is sized for the longest
        # context a CUDA graph may see; cutting each sequence's real context keeps every split busy at any length.
        context_chunk = tl.cdiv(tl.cdiv(context_len - ctx_first, num_splits), BLOCK_N) * BLOCK_N
        ctx_begin = ctx_first + split * context_chunk
        ctx_end = tl.minimum(context_len, ctx_begin + context_chunk)
        page_row = page_tables_ptr + seq.to(tl.int64) * stride_page_table
        if SCALES_AHEAD:
            # The rows' scales are loaded a tile ahead: no product waits on them, so the compiler's pipelining of
            # the dots' operands leaves their latency in every iteration otherwise.
            k_scale_next, v_scale_next = _row_scales(page_row, k_scale_ptr, v_scale_ptr, ctx_begin + keys, ctx_end,
                                                     kv_head, stride_scale_page, stride_scale_slot, stride_scale_head,
                                                     PAGE_SIZE)
        for start in range(ctx_begin, ctx_end, BLOCK_N):
            pos = start + keys
            key_valid = pos < ctx_end
            page = tl.load(page_row + pos // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
            slot_offset = page * stride_cache_page + (pos % PAGE_SIZE) * stride_cache_slot + kv_head * stride_cache_head
            cache_offset = slot_offset[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
            visible = key_valid[None, :]
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > window_edge[:, None])
            if KV_FP8:  # e4m3 values are exact in FP8_DOT_DTYPE; each row's scale goes to its score or weight column
                k = tl.load(k_cache_ptr + cache_offset, mask=key_valid[:, None], other=0.0).to(FP8_DOT_DTYPE)
                v = _widen_e4m3(tl.load(v_cache_ptr + cache_offset, mask=key_valid[:, None], other=0.0), FP8_DOT_DTYPE,
                                WIDEN_IN_PTX)
                if SCALES_AHEAD:
                    k_scale, v_scale = k_scale_next, v_scale_next
                    k_scale_next, v_scale_next = _row_scales(page_row, k_scale_ptr, v_scale_ptr, pos + BLOCK_N,
                                                             ctx_end, kv_head, stride_scale_page, stride_scale_slot,
                                                             stride_scale_head, PAGE_SIZE)
                else:
                    k_scale, v_scale = _row_scales(page_row, k_scale_ptr, v_scale_ptr, pos, ctx_end, kv_head,
                                                   stride_scale_page, stride_scale_slot, stride_scale_head, PAGE_SIZE)
                if RESCALE_Q:
                    qk = tl.dot(q_fp8_dot, tl.trans(k), input_precision=PRECISION)
                    qk = qk * (q_unit[:, None] * (k_scale * scale_log2)[None, :])
                else:
                    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_scale * scale_log2)[None, :]
                acc, m_i, l_i, v_unit = _online_softmax_step(acc, m_i, l_i, v_unit, qk, v, visible, v_scale,
                                                             PRECISION, True)
            else:
                k = tl.load(k_cache_ptr + cache_offset, mask=key_valid[:, None], other=0.0).to(DOT_DTYPE)
                v = tl.load(v_cache_ptr + cache_offset, mask=key_valid[:, None], other=0.0).to(DOT_DTYPE)
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
                acc, m_i, l_i, v_unit = _online_softmax_step(acc, m_i, l_i, v_unit, qk, v, visible, None,
                                                             PRECISION, False)
        if KV_FP8:
            acc = acc * (v_unit / _FP8_WEIGHT_TOP)
        if RESCALE_Q:
            # Loaded again rather than held through the context loop beside its float16 copy: the registers the
            # two copies take made the loop spill.
            q = tl.load(q_rows, mask=row_valid[:, None], other=0.0).to(DOT_DTYPE)
    if HAS_PRIOR:
        # The rows' attention over the cached context, computed by another kernel (flash-attn) as its normalised
        # output and natural log-sum-exp: in this kernel's units, acc = that output over a sum of 1 at a max of
        # lse * log2(e). A row that saw no cached key has an lse of -inf (or NaN) and starts empty.
        lse = tl.load(prior_lse_ptr + head * stride_lse_h + (q_start + token) * stride_lse_t, mask=row_valid,
                      other=float("-inf"))
        seen = lse > -1.0e30
        m_i = tl.where(seen, lse * _LOG2_E, -1.0e30)
        l_i = tl.where(seen, 1.0, 0.0)
        prior_rows = prior_out_ptr + (q_start + token)[:, None] * stride_prior_t + head[:, None] * stride_prior_h
        acc = tl.load(prior_rows + dims[None, :], mask=(row_valid & seen)[:, None], other=0.0).to(tl.float32)

    # The in-forward keys of the sequence, block-masked; only split 0 takes them.
    fwd_end = tl.where(split == 0, q_len, 0)
    for start in range(0, fwd_end, BLOCK_N):
        key_token = start + keys
        key_valid = key_token < q_len
        k = tl.load(
            k_ptr + (q_start + key_token)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
            mask=key_valid[:, None], other=0.0,
        ).to(DOT_DTYPE)
        v = tl.load(
            v_ptr + (q_start + key_token)[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
            mask=key_valid[:, None], other=0.0,
        ).to(DOT_DTYPE)
        k_block = tl.load(block_ids_ptr + q_start + key_token, mask=key_valid, other=2147483647)
        visible = k_block[None, :] <= q_block[:, None]
        if HAS_WINDOW:
            visible = visible & ((context_len + key_token)[None, :] > window_edge[:, None])
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        acc, m_i, l_i, v_unit = _online_softmax_step(acc, m_i, l_i, v_unit, qk, v, visible, None, PRECISION, False)

    if SPLIT:
        # Partials are [splits, tokens, heads(, head_dim)] in float32; the merge kernel reads them.
        row_index = (split * num_tokens + q_start + token).to(tl.int64) * num_heads + head
        tl.store(part_acc_ptr + row_index[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + row_index, m_i, mask=row_valid)
        tl.store(part_sum_ptr + row_index, l_i, mask=row_valid)
    else:
        # Every query row sees at least its own key (inside its window too), so l_i > 0 on valid rows.
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None],
        )


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, scale_ptr,
    stride_ot, stride_oh, num_tokens, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, FP8_OUT: tl.constexpr,
    ACT_DTYPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per token and BLOCK_H of its heads. A row adds its splits' weighted partials one split after
    the other, in split order, so that its sum is the same whichever heads share its program. With FP8_OUT the
    program holds all the token's heads and writes them as one row cast to fp8 with its scale (scale_ptr [T]), as
    `fp8.quantize_rows` casts the ACT_DTYPE output: an fp8 o_proj's input, with no cast launch of its own."""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    head_valid = heads < num_heads
    splits = tl.arange(0, SPLITS)
    rows = (splits[:, None] * num_tokens + token).to(tl.int64) * num_heads + heads[None, :]  # [SPLITS, BLOCK_H]
    # A NaN maximum (a row of NaN scores) makes the row NaN, here as in its weights.
    top = nan_max(tl.load(part_max_ptr + rows, mask=(splits[:, None] < num_splits) & head_valid[None, :],
                          other=-1.0e30), 0)  # [BLOCK_H]
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        row = (split * num_tokens + token).to(tl.int64) * num_heads + heads  # [BLOCK_H]
        here = head_valid & (split < num_splits)
        weight = tl.exp2(tl.load(part_max_ptr + row, mask=here, other=-1.0e30) - top)  # empty splits weigh 0
        acc += tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=here[:, None],
                       other=0.0) * weight[:, None]
        total += tl.load(part_sum_ptr + row, mask=here, other=0.0) * weight
    out = acc / total[:, None]
    if FP8_OUT:
        # Rounded to the activations' dtype first, as the unfused output is before quantize_rows reads it; heads
        # past the last (0 / 0) count for nothing.
        out = tl.where(head_valid[:, None], out.to(ACT_DTYPE).to(tl.float32), 0.0)
        scale = row_scale(abs_max(abs_max(out, 1), 0))
        tl.store(out_ptr + token * stride_ot + heads[:, None] * HEAD_DIM + dims[None, :],
                 cast_to_fp8_range(out, scale).to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
        tl.store(scale_ptr + token, scale)
    else:
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])


# The most values of a token's heads (heads x head_dim) the merge casts to fp8 in one program: LLaDA-8B's 32 heads
# of 128. Wider rows take the float merge and `quantize_rows`.
MAX_FP8_MERGE_VALUES = 8192


class AttentionMetadata(Protocol):
    """What the kernels read of a forward's metadata: the fields of the engine's
    `diffulex_backend.attention.AttentionMetadata`, which is passed as it is."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    context_lens: torch.Tensor  # [B] int32: cached tokens each sequence attends to
    page_tables: torch.Tensor  # [B, max_pages] int32, -1 where unused
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token's K/V, -1 to skip the store
    block_ids: torch.Tensor  # [T] int32: key visible to query when block_ids[key] <= block_ids[query]
    max_seqlen_q: int  # host upper bounds, which size the grid
    max_context_len: int


@dataclass(frozen=True)
class AttentionLaunch:
    """Tile sizes and grid of one launch. A function of host integers only, so a CUDA graph bucket keeps it."""

    block_m: int  # query rows (token x head pairs) per program
    block_n: int  # keys per inner-loop step
    num_splits: int  # context chunks; 1 means no partials and no merge pass
    num_warps: int
    num_stages: int


# Dream-7B's GQA group over a 32-token block (7 heads x 32 tokens) in one tile.
WIDE = AttentionLaunch(block_m=256, block_n=64, num_splits=1, num_warps=8, num_stages=3)


def shared_memory_bytes(launch: AttentionLaunch, head_dim: int, element_size: int) -> int:
    """An estimate of what a program's tiles take in shared memory: its Q tile and `num_stages` buffers of K and V
    tiles. The compiler's figure can exceed it: by 256 to 512 bytes for half-type tiles of 64 rows or more, and by
    up to 17 KB over FP8 rows (tools/attention_spills.py); tests/kernels/test_attention_spills_tool.py holds the
    compiled FP8 and float32 launches to SHARED_MEMORY_BYTES themselves."""
    return element_size * head_dim * (launch.block_m + 2 * launch.block_n * launch.num_stages)


def fits(launch: AttentionLaunch, head_dim: int, element_size: int) -> bool:
    return shared_memory_bytes(launch, head_dim, element_size) <= SHARED_MEMORY_BYTES


@dataclass(frozen=True)
class TileLimits:
    """The tiles a head size and dtype take.

    Half types multiply on the tensor cores: the accumulator [block_m, head_dim] in float32 stays within 128
    registers a thread of four warps (128 rows at head size 128, 32 at 512), and past 128 the key tiles narrow to 32
    so that their buffers fit shared memory. float32 multiplies in float32 (`_precision`), which Hopper does on its
    FMA units with every operand in registers: the tiles are small enough that ptxas (sm_90a) spills under a
    kilobyte a thread, where a 128 x 64 tile at head size 128 spills 136 KB (tools/attention_spills.py)."""

    max_block_m: int
    block_n: int
    num_stages: int
    wide_warps: bool  # every launch runs 8 warps (head sizes past 128)
    long_keys: bool  # launches of up to 32 rows take key tiles of twice block_n (`launch`)

    @staticmethod
    def of(head_dim: int, element_size: int) -> "TileLimits":
        if element_size >= 4:
            return TileLimits(max(16, 2048 // head_dim), 32 if head_dim <= 128 else 16, 2, wide_warps=head_dim > 128,
                              long_keys=False)
        return TileLimits(min(128, 128 * 128 // head_dim), 64 if head_dim <= 128 else 32, 2,
                          wide_warps=head_dim > 128, long_keys=head_dim <= 128)

    def launch(self, block_m: int, num_splits: int) -> AttentionLaunch:
        # 128-row tiles run split programs with 8 warps (short programs); unsplit launches run 4 warps, which
        # leaves room for more programs per multiprocessor.
        num_warps = 8 if self.wide_warps or (num_splits > 1 and block_m >= 128) else 4
        # Each key tile pays a fixed cost (the accumulator's rescale, the row reductions; over FP8 rows the scales'
        # loads too) that a tile of up to 32 rows barely covers: 128 keys halve it, in a split program's chunk as in
        # an unsplit program's whole context (docs/kernels.md). Wider tiles keep block_n: their registers are full.
        long = self.long_keys and block_m <= 32
        return AttentionLaunch(block_m, 2 * self.block_n if long else self.block_n, num_splits, num_warps,
                               self.num_stages)


def takes_wide(head_dim: int, element_size: int) -> bool:
    """Whether the 256-row tile serves: half types (float32 multiplies on the FMA units) up to head size 128."""
    return element_size < 4 and head_dim <= 128 and fits(WIDE, head_dim, element_size)


def max_splits(head_dim: int) -> int:
    """The merge holds every split of a row's [head_dim] partial in registers: fewer splits at wider heads."""
    return MAX_SPLITS * 128 // max(128, head_dim)


def choose_num_splits(base_programs: int, max_context_len: int, num_sms: int, num_warps: int) -> int:
    """How many chunks to cut the cached context into when the launch cannot fill `num_sms` multiprocessors.

    `base_programs` is q tiles x sequences x kv heads. One split (no merge pass) when that already fills the
    GPU or the context is too short for a chunk to pay for its partial round trip. Otherwise aim at about eight
    resident warps per multiprocessor: two 4-warp programs or one 8-warp program. On the H100 more splits than
    that lose to their partials' round trip (Dream-7B's 8-warp tiles at batch 2-8 run fastest at one program
    per multiprocessor), and fewer leave the context reads latency-bound (LLaDA-8B's 4-warp tiles at batch 1).
    """
    if base_programs >= num_sms:
        return 1
    target_programs = num_sms * 8 // num_warps
    return max(1, min(target_programs // base_programs, max_context_len // MIN_SPLIT_CHUNK))


def plan_launch(
    query: torch.Tensor, key: torch.Tensor, meta: AttentionMetadata, *, num_splits: int | None = None,
    window: int | None = None,
) -> AttentionLaunch:
    """The launch `paged_attention` uses by default; `num_splits` forces split-KV on (> 1) or off (1). A window
    bounds the cached keys a sequence reads, and so the splits worth making."""
    group = query.shape[1] // key.shape[1]
    rows = meta.max_seqlen_q * group
    num_seqs, num_kv_heads = meta.cu_seqlens_q.shape[0] - 1, key.shape[1]
    num_sms = multiprocessor_count(query.device)
    # A GQA group wider than 128 rows (Dream-7B: 7 heads x 32 tokens) in one 256-row tile reads each K/V tile
    # once instead of twice. It needs 8 warps and pays only when the batch fills the GPU without splits
    # (`benchmarks/kernels.py --sections attention_sweep` compares it with 128-row tiles at batch 64).
    head_dim, element_size = query.shape[2], query.element_size()
    if num_splits in (None, 1) and 128 < rows <= 256 and num_seqs * num_kv_heads >= num_sms and takes_wide(
            head_dim, element_size):
        return WIDE
    # Otherwise one sequence's block in one tile where it fits, within an MMA-friendly tile.
    limits = TileLimits.of(head_dim, element_size)
    block_m = min(limits.max_block_m, max(16, triton.next_power_of_2(rows)))
    if num_splits is None:
        base_programs = triton.cdiv(rows, block_m) * num_seqs * num_kv_heads
        split_warps = limits.launch(block_m, num_splits=2).num_warps
        context = meta.max_context_len if window is None else min(meta.max_context_len, window)
        num_splits = choose_num_splits(base_programs, context, num_sms, split_warps)
    return limits.launch(block_m, num_splits)


def launch_variants(head_dim: int, element_size: int) -> tuple[AttentionLaunch, ...]:
    """Every launch `plan_launch` can return for this head size and element size, with one split count standing
    for all (the attention kernel takes the count as a runtime argument; only the merge compiles per power of two
    of it)."""
    limits = TileLimits.of(head_dim, element_size)
    rows = [m for m in (16, 32, 64, 128) if m <= limits.max_block_m]
    wide = takes_wide(head_dim, element_size)
    return (*(limits.launch(m, 1) for m in rows), *(limits.launch(m, 2) for m in rows), *([WIDE] if wide else []))


@dataclass(frozen=True)
class _EmptyBatch:
    """One sequence of one token with no cached context on the device, whose host bounds still ask for the
    longest context: the launch it sizes runs every split and reads nothing."""

    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    page_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_ids: torch.Tensor
    max_seqlen_q: int = 1
    max_context_len: int = MAX_SPLITS * 64


def compile_launches(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                     device: torch.device, window: int | None = None, kv_fp8: bool = False,
                     prior: bool = False, fp8_out: bool = False) -> None:
    """Runs every launch variant once, with and without a cache, and the merge at every power of two of splits,
    so that no prompt length or context length compiles a kernel while requests wait. A windowed layer's launches
    are variants of their own (`window`), and so are those over a cache of FP8 rows (`kv_fp8`), the unsplit
    ones that go on from another kernel's attention over the context (`prior`), and the merges that cast their
    rows for an fp8 o_proj (`fp8_out`)."""
    int32 = dict(dtype=torch.int32, device=device)
    batch = _EmptyBatch(cu_seqlens_q=torch.tensor([0, 1], **int32), context_lens=torch.zeros(1, **int32),
                        page_tables=torch.zeros(1, 1, **int32),
                        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),
                        block_ids=torch.zeros(1, **int32))
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    key = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache = (torch.zeros(1, page_size, num_kv_heads, fp8_row_bytes(head_dim), dtype=torch.uint8, device=device)
             if kv_fp8 else torch.zeros(1, page_size, num_kv_heads, head_dim, dtype=dtype, device=device))
    no_context = torch.full((num_heads, 1), float("-inf"), dtype=torch.float32, device=device)  # a prior's lse
    for launch in launch_variants(head_dim, query.element_size()):
        if launch.num_splits == 1:
            paged_attention(query, key, key, None, None, batch, 1.0, launch=launch, window=window)
            paged_attention(query, key, key, cache, cache, batch, 1.0, launch=launch, window=window)
            if prior:
                paged_attention(query, key, key, None, None, batch, 1.0, launch=launch, prior=(query, no_context))
            continue
        splits = 2
        while splits <= max_splits(head_dim):
            for cast in (False, True) if fp8_out else (False,):
                paged_attention(query, key, key, cache, cache, batch, 1.0, launch=replace(launch, num_splits=splits),
                                window=window, fp8_out=cast)
            splits *= 2


def fp8_row_constants(query_dtype: torch.dtype, dot: tl.dtype, launch: AttentionLaunch, kv_fp8: bool,
                      on_gpu: bool) -> dict:
    """How a launch reads FP8 rows (`dot`: the query's dot dtype):
      - FP8_DOT_DTYPE, what the rows widen to: float16 under a half-type query (Hopper widens e4m3 to float16 in
        one instruction per pair of values), else the query's dot dtype (a float32 engine keeps its products in
        float32). Tiles past 128 rows keep the query's dtype: with their registers full, a float16 copy of a
        bfloat16 query made Dream-7B's 256-row tiles slower (docs/kernels.md);
      - RESCALE_Q: a query whose dot dtype is not that one goes to it over a power of two a row;
      - SCALES_AHEAD: tiles of up to 64 rows (LLaDA's 32-token blocks of one head) have the registers to load the
        next tile's scales early; wider ones spill and lose more than the early load saves;
      - WIDEN_IN_PTX: on a GPU, tiles of up to 32 rows that widen to float16 widen the value rows in inline PTX
        (`_widen_e4m3`): the compiler moves a plain cast of theirs past shared memory and gathers the bytes, where
        for wider tiles it widens before shared memory itself (`python tools/attention_spills.py --kv-fp8` counts
        the byte loads). The interpreter, which runs no PTX, casts."""
    widen = tl.float16 if query_dtype in (torch.bfloat16, torch.float16) and launch.block_m <= 128 else dot
    return dict(KV_FP8=kv_fp8, FP8_DOT_DTYPE=widen, RESCALE_Q=kv_fp8 and widen != dot,
                SCALES_AHEAD=kv_fp8 and launch.block_m <= 64,
                WIDEN_IN_PTX=kv_fp8 and on_gpu and launch.block_m <= 32 and widen == tl.float16)


def _precision(query: torch.Tensor) -> str:
    """float32 multiplies in float32: an engine runs in float32 for exactness (a TF32 product's 10-bit mantissa,
    at Gemma's attention scale of 1, moves its softmax weights by percents). Half types multiply exactly anyway."""
    return "ieee" if query.dtype == torch.float32 else "tf32"


def paged_attention(
    query: torch.Tensor,  # [T, heads, head_dim]
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor | None,  # [num_pages, page_size, kv_heads, head_dim], or FP8 rows (kv_store.fp8_rows)
    v_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, heads, head_dim], e.g. a CUDA graph's static buffer
    launch: AttentionLaunch | None = None,  # default: plan_launch(query, key, meta)
    kv_stored: bool = False,  # the caller already stored the in-forward K/V (rotary.rotate_and_store_kv)
    # A sliding window: a query of block id b sees keys at positions > b - window. Every query's block id is at
    # least its sequence's context length (DiffusionGemma's rows are), which lets the context loop start at the
    # window of the earliest row.
    window: int | None = None,
    # Each query row's attention over its cached context, computed by another kernel: (out [T, heads, head_dim],
    # lse [heads, T] float32, natural log, -inf or NaN where a row saw no key), as flash-attn returns them. The kernel
    # then attends to the in-forward keys alone, going on from it; there is no cache to read (k_cache None).
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
    # The output as an fp8 projection takes it: each token's heads as one row cast to float8_e4m3fn with a scale,
    # as `fp8.quantize_rows` casts the output. Where the context is split, the merge of the splits casts it.
    fp8_out: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, heads, head_dim]; fp8_out: ([T, heads * head_dim], [T])
    """Store the in-forward K/V at `slot_mapping >= 0`, then attend; see the module docstring.

    Reads only device-side metadata; `max_seqlen_q` and `max_context_len` (upper bounds) size the grid.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: {num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"paged_attention: head_dim {head_dim} is not supported {HEAD_DIMS}")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("paged_attention: query, key and value need a contiguous head_dim")
    if window is not None and window < 1:  # refused before anything is stored
        raise ValueError(f"paged_attention: window must be at least 1, got {window}")
    if prior is not None:
        prior_out, prior_lse = prior
        if k_cache is not None or window is not None:
            raise ValueError("paged_attention: a prior stands for the cached context: it takes no cache and no window")
        if (prior_out.shape != query.shape or prior_out.stride(-1) != 1 or prior_lse.dtype != torch.float32
                or prior_lse.shape != (num_heads, num_tokens)):
            raise ValueError(f"paged_attention: prior must be (out {tuple(query.shape)} with a contiguous head_dim, "
                             f"lse ({num_heads}, {num_tokens}) float32); got {tuple(prior_out.shape)} and "
                             f"{tuple(prior_lse.shape)} {prior_lse.dtype}")
        prior_strides = (prior_out.stride(0), prior_out.stride(1), prior_lse.stride(0), prior_lse.stride(1))
    else:
        prior_out = prior_lse = query  # never read: HAS_PRIOR=False
        prior_strides = (0, 0, 0, 0)
    if num_tokens == 0:
        if fp8_out:
            return quantize_rows(query.reshape(0, num_heads * head_dim))
        return torch.empty_like(query) if out is None else out
    if launch is None:  # with a prior there is no context to split
        launch = plan_launch(query, key, meta, window=window, num_splits=1 if prior is not None else None)

    has_cache = k_cache is not None
    kv_fp8 = has_cache and k_cache.dtype == torch.uint8
    k_scales = v_scales = key  # never read unless KV_FP8
    scale_strides = (0, 0, 0)
    if has_cache:
        if not kv_stored:
            store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        k_cache, v_cache, k_scales, v_scales, scale_strides = typed_caches(k_cache, v_cache, key)
        page_size = k_cache.shape[1]
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        max_context_len = meta.max_context_len
    else:
        k_cache = v_cache = key  # never read: HAS_CACHE=False compiles the context loop away
        page_size, cache_strides, max_context_len = 16, (0, 0, 0), 0

    if window is not None:
        max_context_len = min(max_context_len, window)  # the cached keys a window lets one sequence read
    num_splits = max(1, min(launch.num_splits, max_splits(head_dim), triton.cdiv(max_context_len, launch.block_n)))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_splits, num_tokens, num_heads, head_dim, device=query.device, dtype=torch.float32)
        part_max = torch.empty(num_splits, num_tokens, num_heads, device=query.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    casting_merge = split and fp8_out and num_heads * head_dim <= MAX_FP8_MERGE_VALUES
    if out is None:
        # With the casting merge the kernel writes only partials and the merge its own fp8 rows: no out is written,
        # and the query stands in for it.
        out = query if casting_merge else torch.empty_like(query)
    if not split:
        part_acc = part_max = part_sum = out  # never touched: SPLIT=False

    group = num_heads // num_kv_heads
    num_seqs = meta.cu_seqlens_q.shape[0] - 1
    num_tiles = triton.cdiv(meta.max_seqlen_q * group, launch.block_m)
    _paged_attention_kernel[(num_tiles, num_seqs * num_kv_heads, num_splits)](
        query, key, value, k_cache, v_cache, k_scales, v_scales,
        meta.cu_seqlens_q, meta.context_lens, meta.page_tables, meta.block_ids,
        out, part_acc, part_max, part_sum, prior_out, prior_lse,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1), *prior_strides,
        *cache_strides, meta.page_tables.stride(0), *scale_strides,
        num_kv_heads, num_tokens, num_heads, num_splits, scale * LOG2_E, 0 if window is None else window,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_CACHE=has_cache,
        SPLIT=split, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, DOT_DTYPE=dot_dtype(query),
        HAS_WINDOW=window is not None,
        **fp8_row_constants(query.dtype, dot_dtype(query), launch, kv_fp8, query.is_cuda),
        PRECISION=_precision(query), HAS_PRIOR=prior is not None, USE_PDL=use_pdl(query),
        num_warps=launch.num_warps, num_stages=launch.num_stages, launch_pdl=use_pdl(query),
    )
    if casting_merge:
        rows = torch.empty(num_tokens, num_heads * head_dim, dtype=FP8, device=query.device)
        scales = torch.empty(num_tokens, dtype=torch.float32, device=query.device)
        _merge_splits(part_acc, part_max, part_sum, rows, scales, num_splits, triton.next_power_of_2(num_heads),
                      out.dtype)
        return rows, scales
    if split:
        _merge_splits(part_acc, part_max, part_sum, out, None, num_splits, 1, out.dtype)
    return quantize_rows(out.reshape(num_tokens, num_heads * head_dim)) if fp8_out else out


def _merge_splits(part_acc, part_max, part_sum, out, scales, num_splits: int, block_h: int, act_dtype) -> None:
    """The merge of split-KV partials [S, T, heads(, head_dim)] into out: [T, heads, head_dim], or with `scales`
    [T, heads * head_dim] fp8 rows, block_h then covering every head."""
    _, num_tokens, num_heads, head_dim = part_acc.shape
    pdl = use_pdl(out)
    _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        part_acc, part_max, part_sum, out, part_max if scales is None else scales,
        out.stride(0), head_dim if scales is not None else out.stride(1), num_tokens, num_heads, num_splits,
        HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(num_splits), BLOCK_H=block_h, FP8_OUT=scales is not None,
        ACT_DTYPE=triton_dtype(act_dtype), USE_PDL=pdl, launch_pdl=pdl,
        # The cast row's program holds a token's every head: wide enough for eight warps.
        num_warps=2 if scales is None else min(8, max(4, block_h * head_dim // 512)),
    )
