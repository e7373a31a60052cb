"""Fused mixture-of-experts MLP: a grouped GEMM over the routed tokens.

    out[t] = sum_k topk_weights[t, k] * w_down[e] @ (act(w_gate_up[e, :I] @ x_t) * (w_gate_up[e, I:] @ x_t)),
    e = topk_ids[t, k], act SiLU (LLaDA2, SDAR, Qwen3) or gelu-tanh (DiffusionGemma)

Three steps, none of which waits on the host, so the whole layer can live in a CUDA graph:

1. `route_to_tiles` sorts the T*K (token, choice) pairs by expert (token order inside an expert) and pads each
   expert's run up to a multiple of the row tile BLOCK_M. A tile holds rows of one expert only; an expert that got
   no token gets no tile. Three small kernels: count each chunk's pairs per expert; plan the runs in one program;
   scatter each pair to its row while other programs mark each tile's expert and padding rows: a chain of torch
   sort, cumsum and scatter ops costs a large share of the layer at decode (docs/kernels.md). The number of
   tiles is only known on the device, so the grid is launched for the most tiles any routing can need, and the
   programs past the last real tile return at once, before any load.
2. `_gate_up_kernel`: one program per (tile, BLOCK_N columns of I). It gathers the tile's token rows of `hidden`,
   streams the expert's gate rows and the up rows that pair with them, and writes act(gate) * up into
   `act` [tiles * BLOCK_M, I], rounded once to the activations' dtype.
3. `_down_kernel`: one program per (tile, BLOCK_N columns of H), product with the expert's down rows, scaled by the
   pair's routing weight, written in float32 to `pair_out` [T*K, H] at the pair's own row; then `_combine_kernel`
   sums each token's K rows in a fixed order. Every element is written by exactly one program and summed in one
   order, so the result is the same bits run after run (atomics into [T, H] would add in arrival order).

Shared experts (`SharedExperts`: a MoE layer's dense MLP that every token takes) can run among the routed ones, so
that at a decode step's few tokens they cost no launches of their own: the routing gives each token S more choices,
experts E to E + S - 1 at weight 1 (`route_experts(..., num_shared=S)`), and a tile of such an expert reads its
I columns of the shared MLP's weights where a routed one reads its stack. Each token's shared rows are one more run
of tiles, so every tile of it reads the shared weights again: worth it while the tokens are few.

FP8 stacks (float8_e4m3fn with float32 scales, layers/fp8_linear.py) take fp8 tensor-core products (W8A8), as the
dense fp8 projections do: the tokens are cast to fp8 with a scale per token (`quantize_rows`), and `_gate_up_kernel`
casts the act rows it writes with a scale per row and per its BLOCK_N columns, which it holds whole, so the cast
costs no launch and no pass of its own. `_down_kernel` scales each K tile's product by its rows' scales (its K tile
lies inside one such group of columns). A weight-only way (W8A16: bf16 tokens, each fp8 weight tile widened in
registers) stays for comparison: at a decode step's few rows the widening, not the weights' bytes, sets its time.

As in `linear.py` the weight rows sit on the wide side of the tensor-core product (acc is [BLOCK_N, BLOCK_M]) and
the tokens on the narrow side, which may be as small as 16.

Why BLOCK_M is 16 when decoding: a block of 32 tokens with 8 choices over 256 experts gives about 1.6 tokens per
touched expert, and touches about 160 of them. The product is bound by reading each touched expert's weights once;
every program streams weights, and the token rows are a rounding error. A taller tile would only compute more
padding rows. A second tile of the same expert reads that expert's weights again (mostly from L2), so BLOCK_M grows
with the average number of pairs per expert, where the product turns compute-bound.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dtypes import dot_dtype, triton_dtype
from .fp8 import FP8, FP8_PROMOTE_EVERY, quantize_rows, quantize_rows_reference
from .fp8_cast import abs_max, cast_to_fp8_range, row_scale
from .pdl import use_pdl, wait_for_previous_kernel

# How the expert kernels scale their weights: not at all (float stacks), or fp8 stacks with one scale per row or
# one per row and group of columns.
NO_SCALE, PER_CHANNEL, GROUPED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# The gate's activation: SiLU, or GELU with its tanh approximation (torch's approximate="tanh").
SILU, GELU_TANH = 0, 1
_GELU_TANH = tl.constexpr(GELU_TANH)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_FP8_PROMOTE_EVERY = tl.constexpr(FP8_PROMOTE_EVERY)


@dataclass(frozen=True)
class MoeLaunch:
    block_m: int  # routed rows per tile (tensor cores need at least 16)
    block_n: int  # weight rows per program
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class SharedExperts:
    """Experts every token takes at weight 1, held as one gated MLP of S * I columns (I the stacks' intermediate
    size): `w_gate_up` [2 * S * I, H], gate rows then up rows, and `w_down` [H, S * I], with fp8 scales shaped as
    the stacks' are ([2 * S * I, G] and [H, G'], G' columns groups over S * I), or None for float weights. Shared
    expert s is the MLP's columns s * I to (s + 1) * I."""
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    w_gate_up_scale: torch.Tensor | None = None
    w_down_scale: torch.Tensor | None = None

    def count(self, inter: int) -> int:
        """S: how many experts of `inter` columns the MLP holds."""
        return self.w_down.shape[1] // inter


def plan_moe_launch(num_pairs: int, num_experts: int, element_size: int = 2) -> MoeLaunch:
    """The launch `fused_moe` uses; element_size: the bytes of the products' operands (1 for W8A8).

    The row tile follows the average number of pairs per expert: 16 at decode (see the module's note); past that, a
    tile about as tall as the average run, with wide weight tiles, as a compute-bound GEMM wants. On an H100 at
    LLaDA2-mini's and Qwen3-30B-A3B's expert shapes this picks the fastest of the tiles benchmarks/moe.py times, or
    one within 3% of it (docs/kernels.md). The tiles are sized for 16-bit operands; 32-bit ones take half the depth
    (block_k), so that the stages in flight hold the same bytes and fit shared memory. fp8 ones take 128 columns
    by 128 weight rows everywhere (a 16-bit stage's bytes, and groups of 128 act columns for the cast) in three
    stages with four warps, in 16-row tiles up to 16 pairs an expert and 32-row tiles past that: on an H200 the
    fastest of the tiles benchmarks/moe.py times at both shapes, from 32 to 2048 tokens, and at 32 and 256 tokens
    routed among 60 experts. Taller fp8 tiles were slower at every count timed, up to 1.6 times at 2048 tokens."""
    per_expert = num_pairs / num_experts
    if element_size == 1:
        return MoeLaunch(16 if per_expert <= 16 else 32, block_n=128, block_k=128, num_warps=4, num_stages=3)
    if per_expert <= 8:
        # Weight-bound: 4 stages of a 64x128 weight tile pair keep enough bytes in flight (as in linear.py).
        launch = MoeLaunch(16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif per_expert <= 16:
        launch = MoeLaunch(32, block_n=64, block_k=128, num_warps=4, num_stages=4)
    else:
        launch = MoeLaunch(64 if per_expert <= 64 else 128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if element_size > 2:
        launch = replace(launch, block_k=launch.block_k * 2 // element_size)
    return launch


@dataclass(frozen=True)
class RoutedTiles:
    """The pairs of a routing, grouped by expert and padded to whole tiles. A pair is token * K + choice."""
    pair_ids: torch.Tensor  # [max_tiles * block_m] int32; num_pairs marks a padding row
    tile_experts: torch.Tensor  # [max_tiles] int32; num_experts marks a tile past the last real one
    block_m: int

    @property
    def max_tiles(self) -> int:
        return self.tile_experts.numel()


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles any routing of num_pairs pairs can need: each touched expert (at most min(E, pairs) of them)
    pads its run by at most block_m - 1 rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


ROUTE_CHUNK = 128  # pairs per program of the counting and scattering kernels
PLAN_CHUNKS = 16  # chunks per step of the planning kernel
TILE_BLOCK = 64  # tiles per program of the scattering kernel


# Pair, chunk and tile counts change with every batch: kernels specialized on them would compile again for each
# new count class while requests wait.
@triton.jit(do_not_specialize=["num_pairs"])
def _count_experts_kernel(ids_ptr, chunk_counts_ptr, num_pairs, E_POW2: tl.constexpr, CHUNK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """chunk_counts[c, e]: how many pairs of chunk c go to expert e."""
    wait_for_previous_kernel(USE_PDL)
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_pairs
    experts = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    tl.store(chunk_counts_ptr + chunk * E_POW2 + tl.arange(0, E_POW2), tl.histogram(experts, E_POW2, mask=valid))


@triton.jit(do_not_specialize=["num_chunks"])
def _plan_runs_kernel(chunk_counts_ptr, chunk_starts_ptr, runs_ptr, num_chunks,
                      E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    """One program: each expert's pair count and the tile after its run (runs [2, E_POW2]), and the row where each
    chunk's pairs of each expert start (chunk_starts [chunks, E_POW2])."""
    wait_for_previous_kernel(USE_PDL)
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for c in range(0, num_chunks, CHUNKS):
        chunks = c + tl.arange(0, CHUNKS)
        block = tl.load(chunk_counts_ptr + chunks[:, None] * E_POW2 + experts[None, :],
                        mask=chunks[:, None] < num_chunks, other=0)  # [CHUNKS, E_POW2]
        counts += tl.sum(block, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    tl.store(runs_ptr + experts, counts)
    tl.store(runs_ptr + E_POW2 + experts, tiles_end)
    seen = (tiles_end - tiles) * BLOCK_M  # the row of each expert's next pair
    for c in range(0, num_chunks, CHUNKS):
        chunks = c + tl.arange(0, CHUNKS)
        in_range = chunks[:, None] < num_chunks
        block = tl.load(chunk_counts_ptr + chunks[:, None] * E_POW2 + experts[None, :], mask=in_range, other=0)
        tl.store(chunk_starts_ptr + chunks[:, None] * E_POW2 + experts[None, :],
                 seen[None, :] + tl.cumsum(block, 0) - block, mask=in_range)
        seen += tl.sum(block, 0)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_tiles"])
def _scatter_pairs_kernel(ids_ptr, chunk_starts_ptr, runs_ptr, pair_ids_ptr, tile_experts_ptr,
                          num_pairs, num_experts, num_chunks, num_tiles,
                          E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """The first num_chunks programs put each pair of their chunk in its row: the chunk's start for its expert,
    plus the chunk's earlier pairs of that expert. The others write the expert of TILES tiles each, and mark their
    padding rows."""
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    if pid < num_chunks:
        lane = tl.arange(0, CHUNK)
        offs = pid * CHUNK + lane
        valid = offs < num_pairs
        experts = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        earlier = (experts[:, None] == experts[None, :]) & (lane[None, :] < lane[:, None])  # [CHUNK, CHUNK]
        rank = tl.sum(earlier.to(tl.int32), 1)
        row = tl.load(chunk_starts_ptr + pid * E_POW2 + experts, mask=valid, other=0) + rank
        tl.store(pair_ids_ptr + row, offs, mask=valid)
    else:
        all_experts = tl.arange(0, E_POW2)
        counts = tl.load(runs_ptr + all_experts)
        tiles_end = tl.load(runs_ptr + E_POW2 + all_experts)
        tile = (pid - num_chunks) * TILES + tl.arange(0, TILES)
        passed = tiles_end[None, :] <= tile[:, None]  # [TILES, E_POW2] experts whose run ends before the tile
        expert = tl.sum(passed.to(tl.int32), 1)  # E_POW2 past the last run
        run_start = tl.max(tl.where(passed, tiles_end[None, :], 0), 1)
        count = tl.sum(tl.where(all_experts[None, :] == expert[:, None], counts[None, :], 0), 1)
        in_range = tile < num_tiles
        tl.store(tile_experts_ptr + tile, tl.minimum(expert, num_experts), mask=in_range)
        rows = tl.arange(0, BLOCK_M)
        padding = (tile[:, None] - run_start[:, None]) * BLOCK_M + rows[None, :] >= count[:, None]
        tl.store(pair_ids_ptr + tile[:, None] * BLOCK_M + rows[None, :],
                 tl.full([TILES, BLOCK_M], 0, tl.int32) + num_pairs, mask=padding & in_range[:, None])


def route_to_tiles(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutedTiles:
    """Sorts the pairs of topk_ids [T, K] by expert (token order inside an expert) and pads each expert's run to
    block_m rows. Three small kernels and no host synchronisation: the sizes come from the shapes alone."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs, device = ids.numel(), ids.device
    num_tiles = max_tiles(num_pairs, num_experts, block_m)
    num_chunks = triton.cdiv(num_pairs, ROUTE_CHUNK)
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk_counts = torch.empty(num_chunks, e_pow2, dtype=torch.int32, device=device)
    chunk_starts = torch.empty_like(chunk_counts)
    runs = torch.empty(2, e_pow2, dtype=torch.int32, device=device)
    pair_ids = torch.empty(num_tiles * block_m, dtype=torch.int32, device=device)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    pdl = use_pdl(ids)
    _count_experts_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, E_POW2=e_pow2, CHUNK=ROUTE_CHUNK,
                                         USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    # The plan's one program walks short per-chunk counts, which four warps hold; the scatter's [CHUNK, CHUNK] and
    # [TILES, E_POW2] tiles want eight.
    _plan_runs_kernel[(1,)](chunk_counts, chunk_starts, runs, num_chunks, E_POW2=e_pow2, BLOCK_M=block_m,
                            CHUNKS=PLAN_CHUNKS, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    _scatter_pairs_kernel[(num_chunks + triton.cdiv(num_tiles, TILE_BLOCK),)](
        ids, chunk_starts, runs, pair_ids, tile_experts, num_pairs, num_experts, num_chunks, num_tiles,
        E_POW2=e_pow2, BLOCK_M=block_m, CHUNK=ROUTE_CHUNK, TILES=TILE_BLOCK, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=8,
    )
    return RoutedTiles(pair_ids, tile_experts, block_m)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, x_scale_ptr, w_ptr, act_ptr, act_scale_ptr, pair_ids_ptr, tile_experts_ptr, scale_ptr, shared_w_ptr,
    shared_scale_ptr, num_pairs, num_experts, H, INTER, stride_xt, stride_we, stride_wn, stride_am, ACT_GROUPS,
    GROUPS, GROUP_K,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    W_SCALE: tl.constexpr, ACTIVATION: tl.constexpr, FP8_ROWS: tl.constexpr, ACT_DTYPE: tl.constexpr,
    NUM_SHARED: tl.constexpr,
):
    """W_SCALE: NO_SCALE, or fp8 weights with their [E, 2I, GROUPS] scales, PER_CHANNEL (GROUPS 1) or GROUPED
    (GROUP_K columns per scale, a multiple of BLOCK_K). ACTIVATION: SILU or GELU_TANH, of the gate. FP8_ROWS: x is
    fp8 with a scale per token, the products are fp8 ones, and act is written in fp8 with a scale per row and per
    this program's BLOCK_N columns (act_scale [rows, ACT_GROUPS]); each act value is rounded to ACT_DTYPE first.
    Experts num_experts to num_experts + NUM_SHARED - 1 are the shared MLP's (SharedExperts): its weights at
    shared_w_ptr [2 * NUM_SHARED * INTER, H] (row stride stride_wn, as the stack's), its scales at
    shared_scale_ptr."""
    wait_for_previous_kernel(USE_PDL)
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts + NUM_SHARED:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + offs_m)
    m_valid = pairs < num_pairs
    tokens = pairs // TOP_K
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    # The expert's first gate row and its scales, and how many rows below them its up rows lie: in its stack for a
    # routed expert, in the shared MLP (whose gate rows all come before its up rows) for a shared one.
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = scale_ptr + expert.to(tl.int64) * 2 * INTER * GROUPS
    up_rows = INTER
    if NUM_SHARED > 0:
        if expert >= num_experts:
            chunk = (expert - num_experts).to(tl.int64)
            w_base = shared_w_ptr + chunk * INTER * stride_wn
            s_base = shared_scale_ptr + chunk * INTER * GROUPS
            up_rows = NUM_SHARED * INTER
    gate_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + up_rows * stride_wn
    x_ptrs = x_ptr + tokens[None, :].to(tl.int64) * stride_xt + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_valid[None, :], other=0.0)
            gate = tl.load(gate_ptrs, mask=n_valid[:, None], other=0.0)
            up = tl.load(up_ptrs, mask=n_valid[:, None], other=0.0)
        else:
            k_valid = offs_k + k < H
            x = tl.load(x_ptrs, mask=m_valid[None, :] & k_valid[:, None], other=0.0)
            gate = tl.load(gate_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
            up = tl.load(up_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if W_SCALE == GROUPED:
            # [BLOCK_N] scales of this column group, gate rows then up rows.
            s_ptrs = s_base + offs_n * GROUPS + k // GROUP_K
            s_gate = tl.load(s_ptrs, mask=n_valid, other=0.0)
            s_up = tl.load(s_ptrs + up_rows * GROUPS, mask=n_valid, other=0.0)
            acc_gate += _product(gate, x, None, DOT_DTYPE, PRECISION, FP8_ROWS) * s_gate[:, None]
            acc_up += _product(up, x, None, DOT_DTYPE, PRECISION, FP8_ROWS) * s_up[:, None]
        else:
            acc_gate = _product(gate, x, acc_gate, DOT_DTYPE, PRECISION, FP8_ROWS)
            acc_up = _product(up, x, acc_up, DOT_DTYPE, PRECISION, FP8_ROWS)
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if W_SCALE == PER_CHANNEL:
        s_ptrs = s_base + offs_n
        acc_gate = acc_gate * tl.load(s_ptrs, mask=n_valid, other=0.0)[:, None]
        acc_up = acc_up * tl.load(s_ptrs + up_rows, mask=n_valid, other=0.0)[:, None]
    if FP8_ROWS:
        x_scale = tl.load(x_scale_ptr + tokens, mask=m_valid, other=0.0)[None, :]
        acc_gate = acc_gate * x_scale
        acc_up = acc_up * x_scale
    if ACTIVATION == _GELU_TANH:
        # tanh(y) as 2 sigmoid(2y) - 1, which saturates to +-1 where exp overflows.
        y = _SQRT_2_OVER_PI * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
        act = 0.5 * acc_gate * (2.0 / (1.0 + tl.exp(-2.0 * y))) * acc_up
    else:
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    act_ptrs = act_ptr + offs_m[None, :].to(tl.int64) * stride_am + offs_n[:, None]
    store_mask = n_valid[:, None] & m_valid[None, :]
    if FP8_ROWS:
        # Columns past I are 0 (their weights load as 0), so the group's largest magnitude is its real columns'.
        act = act.to(ACT_DTYPE).to(tl.float32)
        act_scale = row_scale(abs_max(act, 0))  # [BLOCK_M]
        tl.store(act_ptrs, cast_to_fp8_range(act, act_scale[None, :]).to(act_ptr.dtype.element_ty), mask=store_mask)
        tl.store(act_scale_ptr + offs_m.to(tl.int64) * ACT_GROUPS + pid_n, act_scale, mask=m_valid)
    else:
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _product(w, x, acc, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, FP8_ROWS: tl.constexpr):
    """acc + w [N, K] @ x [K, M] in float32 (acc None: the product alone): an fp8 product promoted to float32 every
    FP8_PROMOTE_EVERY terms (fp8.py), or both operands widened to DOT_DTYPE."""
    if FP8_ROWS:
        return tl.dot(w, x, acc, max_num_imprecise_acc=_FP8_PROMOTE_EVERY)
    return tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, act_scale_ptr, w_ptr, topk_weights_ptr, pair_out_ptr, pair_ids_ptr, tile_experts_ptr, scale_ptr,
    shared_w_ptr, shared_scale_ptr, num_pairs, num_experts, H, INTER, stride_am, stride_we, stride_wn, stride_swn,
    stride_op, ACT_GROUPS, ACT_GROUP_K, GROUPS, GROUP_K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    W_SCALE: tl.constexpr, FP8_ROWS: tl.constexpr, NUM_SHARED: tl.constexpr,
):
    """FP8_ROWS: act is fp8 with a scale per row and group of ACT_GROUP_K columns (a multiple of BLOCK_K), which
    scales each K tile's product. Experts num_experts to num_experts + NUM_SHARED - 1 are the shared MLP's: its down
    weight at shared_w_ptr [H, NUM_SHARED * INTER] (row stride stride_swn), its scales at shared_scale_ptr."""
    wait_for_previous_kernel(USE_PDL)
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts + NUM_SHARED:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + offs_m)
    m_valid = pairs < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    # The expert's down rows and their scales: its stack's for a routed expert; for a shared one its INTER columns
    # of the shared MLP's rows, and of their column groups' scales when the scales have groups.
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_stride = stride_wn
    s_base = scale_ptr + expert.to(tl.int64) * H * GROUPS
    s_stride = GROUPS
    if NUM_SHARED > 0:
        if expert >= num_experts:
            chunk = (expert - num_experts).to(tl.int64)
            w_base = shared_w_ptr + chunk * INTER
            w_stride = stride_swn
            if W_SCALE == GROUPED:
                s_base = shared_scale_ptr + chunk * GROUPS
                s_stride = NUM_SHARED * GROUPS
            else:
                s_base = shared_scale_ptr
    w_ptrs = w_base + offs_n[:, None].to(tl.int64) * w_stride + offs_k[None, :]
    a_ptrs = act_ptr + offs_m[None, :].to(tl.int64) * stride_am + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    a_scale_ptrs = act_scale_ptr + offs_m.to(tl.int64) * ACT_GROUPS
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_valid[:, None], other=0.0)
        else:
            k_valid = offs_k + k < INTER
            a = tl.load(a_ptrs, mask=m_valid[None, :] & k_valid[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if W_SCALE == GROUPED or FP8_ROWS:
            product = _product(w, a, None, DOT_DTYPE, PRECISION, FP8_ROWS)
            if W_SCALE == GROUPED:
                s = tl.load(s_base + offs_n * s_stride + k // GROUP_K, mask=n_valid, other=0.0)
                product = product * s[:, None]
            if FP8_ROWS:
                product = product * tl.load(a_scale_ptrs + k // ACT_GROUP_K, mask=m_valid, other=0.0)[None, :]
            acc += product
        else:
            acc = _product(w, a, acc, DOT_DTYPE, PRECISION, FP8_ROWS)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if W_SCALE == PER_CHANNEL:
        acc = acc * tl.load(s_base + offs_n * s_stride, mask=n_valid, other=0.0)[:, None]
    routing_weight = tl.load(topk_weights_ptr + pairs, mask=m_valid, other=0.0).to(tl.float32)
    acc = acc * routing_weight[None, :]
    out_ptrs = pair_out_ptr + pairs[None, :].to(tl.int64) * stride_op + offs_n[:, None]
    tl.store(out_ptrs, acc, mask=n_valid[:, None] & m_valid[None, :])


# The shared partials' stride (T x H) changes with every batch.
@triton.jit(do_not_specialize=["stride_ss"])
def _combine_kernel(pair_out_ptr, shared_ptr, out_ptr, H, stride_ss, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
                    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = sum over k, in order, of pair_out[t * TOP_K + k], then of NUM_SHARED partial sums shared[s, t]."""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pair_out_ptr + (token * TOP_K + k) * H + offs, mask=valid, other=0.0)
    for s in tl.static_range(NUM_SHARED):
        acc += tl.load(shared_ptr + s * stride_ss + token * H + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


def _check(hidden, w_gate_up, w_down, topk_ids, topk_weights) -> None:
    tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w_gate_up.shape
    if w_gate_up.shape != (num_experts, two_inter, hidden_size) or two_inter % 2:
        raise ValueError(f"fused_moe: w_gate_up must be [E, 2I, {hidden_size}], got {tuple(w_gate_up.shape)}")
    if w_down.shape != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(f"fused_moe: w_down must be [{num_experts}, {hidden_size}, {two_inter // 2}], "
                         f"got {tuple(w_down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"fused_moe: topk_ids and topk_weights must both be [{tokens}, K], "
                         f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")


def fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, launch: MoeLaunch | None = None, w_gate_up_scale: torch.Tensor | None = None,
              w_down_scale: torch.Tensor | None = None, activation: int = SILU, weight_only: bool = False,
              rows: tuple[torch.Tensor, torch.Tensor] | None = None, shared: torch.Tensor | None = None,
              shared_experts: SharedExperts | None = None) -> torch.Tensor:
    """The routed experts' MLP, weighted and summed per token; the gate's activation SILU or GELU_TANH.

    hidden [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows); w_down [E, H, I]; topk_ids [T, K] (int, distinct
    in a row); topk_weights [T, K] float32 -> [T, H] in hidden's dtype. bf16, fp16 or fp32, accumulated in fp32.

    FP8 stacks (float8_e4m3fn, with float32 scales [E, 2I, G] and [E, H, G], layers/fp8_linear.py) take fp8
    products (W8A8): the tokens cast with a scale per token, the act rows with a scale per row and group of
    launch.block_n columns (`fused_moe_reference` with `act_group` is this math in torch). With `weight_only` the
    tokens stay in hidden's dtype and each fp8 weight is widened to it in registers. The weights' scales apply per
    row, after the sum over K with one scale a row, or per group of columns with G > 1.

    rows: hidden already cast for W8A8 (quantize_rows' q and scale), when another product takes the same cast.
    shared: partial sums [S, T, H] added to each token's sum before its one rounding (a shared expert's).
    shared_experts: experts E to E + S - 1 (SharedExperts), which topk_ids then names in its last S columns, after
    the routed choices (route_experts' num_shared). Without them every id must be below E: ids are addresses."""
    _check(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    num_shared = _check_shared(shared_experts, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    if num_shared and topk_ids.shape[1] <= num_shared:
        raise ValueError(f"fused_moe: with {num_shared} shared experts, topk_ids [T, K] holds K - {num_shared} routed "
                         f"choices and then the shared ones, so K must exceed {num_shared}; got "
                         f"{tuple(topk_ids.shape)}")
    num_pairs, num_experts = topk_ids.numel(), w_down.shape[0] + num_shared
    if num_pairs == 0:
        return torch.empty_like(hidden)
    fp8_rows = w_gate_up_scale is not None and not weight_only
    if launch is None:
        launch = plan_moe_launch(num_pairs, num_experts, 1 if fp8_rows else hidden.element_size())
    routed = route_to_tiles(topk_ids, num_experts, launch.block_m)
    if fp8_rows:
        x, x_scale = rows if rows is not None else quantize_rows(hidden.contiguous())
    else:
        x, x_scale = hidden, None
    act, act_scale = gate_up_act(x, w_gate_up, routed, topk_ids.shape[1], launch, w_gate_up_scale, activation,
                                 x_scale, hidden.dtype, shared_experts)
    return down_and_combine(act, w_down, topk_weights, routed, hidden.shape[0], launch, w_down_scale, act_scale,
                            hidden.dtype, shared, shared_experts)


def shared_experts_misfit(shared: SharedExperts, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None) -> str | None:
    """Why the shared experts cannot run among the stacks' experts, or None when they can: the same dtype, whole
    experts of the stacks' intermediate size, and scales shaped as the stacks' are."""
    _, hidden_size, inter = w_down.shape
    count = shared.count(inter)
    if (count < 1 or shared.w_down.shape != (hidden_size, count * inter)
            or shared.w_gate_up.shape != (2 * count * inter, hidden_size)
            or shared.w_gate_up.dtype != w_gate_up.dtype or shared.w_down.dtype != w_down.dtype):
        return (f"shared experts {tuple(shared.w_gate_up.shape)} {shared.w_gate_up.dtype} and "
                f"{tuple(shared.w_down.shape)} {shared.w_down.dtype} are not whole experts of the stacks' {inter} "
                f"columns ({tuple(w_gate_up.shape)} {w_gate_up.dtype} and {tuple(w_down.shape)} {w_down.dtype})")
    if (shared.w_gate_up_scale is None) != (w_gate_up_scale is None) or (
            shared.w_down_scale is None) != (w_down_scale is None):
        return "shared experts take scales exactly when the stacks do"
    if w_gate_up_scale is not None:
        down_groups = w_down_scale.shape[-1]
        want_down = (hidden_size, count * down_groups if down_groups > 1 else 1)
        if shared.w_gate_up_scale.shape != (2 * count * inter, w_gate_up_scale.shape[-1]) or \
                shared.w_down_scale.shape != want_down:
            return (f"shared experts' scales {tuple(shared.w_gate_up_scale.shape)} and "
                    f"{tuple(shared.w_down_scale.shape)} are not shaped as the stacks' "
                    f"{tuple(w_gate_up_scale.shape)} and {tuple(w_down_scale.shape)}")
    return None


def _check_shared(shared: SharedExperts | None, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None) -> int:
    """S, the shared experts' count (0 for None), once they are checked to fit the stacks."""
    if shared is None:
        return 0
    why = shared_experts_misfit(shared, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    if why is not None:
        raise ValueError(f"fused_moe: {why}")
    return shared.count(w_down.shape[-1])


def _shared_args(shared: SharedExperts | None, weight: torch.Tensor, scale_args: dict, part: str) -> dict:
    """The expert kernels' shared-expert arguments for `part` ("gate_up" or "down"): the shared MLP's weight and
    scales, or the stack's own (never read) without shared experts."""
    if shared is None:
        return dict(shared_w_ptr=weight, shared_scale_ptr=scale_args["scale_ptr"], NUM_SHARED=0)
    w, scale = (shared.w_gate_up, shared.w_gate_up_scale) if part == "gate_up" else (shared.w_down, shared.w_down_scale)
    return dict(shared_w_ptr=w.contiguous(), shared_scale_ptr=w if scale is None else scale.float().contiguous(),
                NUM_SHARED=shared.count(weight.shape[-1] if part == "down" else weight.shape[1] // 2))


def _scale_args(weight: torch.Tensor, scale: torch.Tensor | None) -> dict:
    """The kernels' weight-scale arguments: none for a float stack; an fp8 stack's scales and their grouping."""
    if scale is None:
        if weight.dtype == FP8:
            raise ValueError("fused_moe: an fp8 stack takes its scales")
        return dict(scale_ptr=weight, GROUPS=1, GROUP_K=weight.shape[-1], W_SCALE=NO_SCALE)
    if weight.dtype != FP8 or scale.shape != (*weight.shape[:-1], scale.shape[-1]):
        raise ValueError(f"fused_moe: an fp8 stack {tuple(weight.shape)} {weight.dtype} takes scales "
                         f"[E, N, G], got {tuple(scale.shape)}")
    groups = scale.shape[-1]
    return dict(scale_ptr=scale.float().contiguous(), GROUPS=groups, GROUP_K=weight.shape[-1] // groups,
                W_SCALE=PER_CHANNEL if groups == 1 else GROUPED)


def _k_tile(launch: MoeLaunch, scale: torch.Tensor | None, k: int, fp8_rows: bool, act_group: int | None = None
            ) -> MoeLaunch:
    """The launch with its K tile inside one column group of a block-scaled stack's scales, and of fp8 act rows'
    scales (act_group columns each). A tile is a power of two of columns, of at least 32 in an fp8 product (the
    tensor cores' K step); a 16-bit product of a weight-only stack takes narrower ones."""
    block_k = launch.block_k
    if scale is not None and scale.shape[-1] > 1:
        block_k = min(block_k, k // scale.shape[-1])
    if act_group is not None:
        block_k = min(block_k, act_group)
    if block_k & (block_k - 1) or (fp8_rows and block_k < 32):
        raise ValueError(f"fused_moe: a K tile of {block_k} columns (launch block_k {launch.block_k}, scale groups of "
                         f"{k // scale.shape[-1] if scale is not None else k} columns, act groups of "
                         f"{act_group or k}) is not a power of two{' of at least 32' if fp8_rows else ''}")
    return replace(launch, block_k=block_k)


def _kernel_options(rows: torch.Tensor, launch: MoeLaunch) -> dict:
    dot = dot_dtype(rows)
    pdl = use_pdl(rows)
    # A float32 product in tf32 on the GPU would be less exact than the float32 it promises.
    return dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, DOT_DTYPE=dot,
                PRECISION="ieee" if dot == tl.float32 else "tf32", FP8_ROWS=rows.dtype == FP8, USE_PDL=pdl,
                launch_pdl=pdl, num_warps=launch.num_warps, num_stages=launch.num_stages)


def gate_up_act(hidden: torch.Tensor, w_gate_up: torch.Tensor, routed: RoutedTiles, top_k: int,
                launch: MoeLaunch, scale: torch.Tensor | None = None, activation: int = SILU,
                hidden_scale: torch.Tensor | None = None, act_dtype: torch.dtype | None = None,
                shared_experts: SharedExperts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """act(gate) * up of every routed row: [max_tiles * block_m, I] (padding rows unwritten) in act_dtype (hidden's
    by default), and None; or, for fp8 rows (hidden fp8 with `hidden_scale` [T], fp8 stacks, and act_dtype the
    activations' dtype), the act rows rounded to act_dtype and cast to fp8 with their scales
    [max_tiles * block_m, cdiv(I, block_n)], one per row and group of block_n columns."""
    if activation not in (SILU, GELU_TANH):
        raise ValueError(f"fused_moe: activation must be SILU ({SILU}) or GELU_TANH ({GELU_TANH}), got {activation!r}")
    fp8_rows = hidden.dtype == FP8
    if fp8_rows != (hidden_scale is not None) or (fp8_rows and (scale is None or act_dtype is None)):
        raise ValueError("fused_moe: fp8 tokens take their scales, fp8 stacks and the activations' dtype")
    if fp8_rows and launch.block_n < 32:
        raise ValueError(f"fused_moe: fp8 act rows are cast in groups of block_n columns, which the down product's fp8 "
                         f"K tile must fill: at least 32, got {launch.block_n}")
    hidden, w_gate_up = hidden.contiguous(), w_gate_up.contiguous()
    num_experts, inter, hidden_size = w_gate_up.shape[0], w_gate_up.shape[1] // 2, hidden.shape[1]
    launch = _k_tile(launch, scale, hidden_size, fp8_rows)
    act_dtype = act_dtype or hidden.dtype
    rows, groups = routed.max_tiles * launch.block_m, triton.cdiv(inter, launch.block_n)
    act = torch.empty(rows, inter, dtype=act_dtype if not fp8_rows else FP8, device=hidden.device)
    act_scale = torch.empty(rows, groups, dtype=torch.float32, device=hidden.device) if fp8_rows else None
    scale_args = _scale_args(w_gate_up, scale)
    _gate_up_kernel[(routed.max_tiles, groups)](
        hidden, hidden_scale if fp8_rows else hidden, w_gate_up, act, act_scale if fp8_rows else act,
        routed.pair_ids, routed.tile_experts, **_shared_args(shared_experts, w_gate_up, scale_args, "gate_up"),
        num_pairs=hidden.shape[0] * top_k, num_experts=num_experts, H=hidden_size, INTER=inter,
        stride_xt=hidden.stride(0), stride_we=w_gate_up.stride(0), stride_wn=w_gate_up.stride(1),
        stride_am=act.stride(0), ACT_GROUPS=groups, TOP_K=top_k, EVEN_K=hidden_size % launch.block_k == 0,
        ACTIVATION=activation, ACT_DTYPE=triton_dtype(act_dtype), **scale_args, **_kernel_options(hidden, launch),
    )
    return act, act_scale


def down_and_combine(act: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, routed: RoutedTiles,
                     tokens: int, launch: MoeLaunch, scale: torch.Tensor | None = None,
                     act_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     shared: torch.Tensor | None = None, shared_experts: SharedExperts | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * (w_down[e] @ act of pair (t, k)), plus sum_s shared[s, t] when given: [tokens, H]
    in out_dtype (act's by default; fp8 act rows take it given). fp8 act rows come with gate_up_act's scales, whose
    groups of launch.block_n columns each K tile stays in."""
    w_down, topk_weights = w_down.contiguous(), topk_weights.float().contiguous()
    num_experts, hidden_size, inter = w_down.shape
    top_k = topk_weights.shape[1]
    fp8_rows = act.dtype == FP8
    if fp8_rows != (act_scale is not None) or (fp8_rows and (scale is None or out_dtype is None)):
        raise ValueError("fused_moe: fp8 act rows take their scales, fp8 stacks and the output's dtype")
    # fp8 act rows' scales cover the columns of one of gate_up's programs: launch.block_n.
    act_group = launch.block_n if fp8_rows else None
    launch = _k_tile(launch, scale, inter, fp8_rows, act_group)
    pair_out = torch.empty(tokens * top_k, hidden_size, dtype=torch.float32, device=act.device)
    scale_args = _scale_args(w_down, scale)
    shared_args = _shared_args(shared_experts, w_down, scale_args, "down")
    _down_kernel[(routed.max_tiles, triton.cdiv(hidden_size, launch.block_n))](
        act, act_scale if fp8_rows else act, w_down, topk_weights, pair_out, routed.pair_ids, routed.tile_experts,
        **shared_args, num_pairs=tokens * top_k, num_experts=num_experts, H=hidden_size, INTER=inter,
        stride_am=act.stride(0), stride_we=w_down.stride(0), stride_wn=w_down.stride(1),
        stride_swn=shared_args["shared_w_ptr"].stride(0), stride_op=pair_out.stride(0),
        ACT_GROUPS=act_scale.shape[1] if fp8_rows else 1, ACT_GROUP_K=act_group or 1,
        EVEN_K=inter % launch.block_k == 0, **scale_args, **_kernel_options(act, launch),
    )
    out = torch.empty(tokens, hidden_size, dtype=out_dtype or act.dtype, device=act.device)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    pdl = use_pdl(act)
    if shared is not None:
        if shared.dim() != 3 or shared.shape[1:] != (tokens, hidden_size):
            raise ValueError(f"fused_moe: shared partial sums must be [S, {tokens}, {hidden_size}], "
                             f"got {tuple(shared.shape)}")
        shared = shared.contiguous()
    _combine_kernel[(tokens, triton.cdiv(hidden_size, block_h))](
        pair_out, shared if shared is not None else pair_out, out, hidden_size,
        shared.stride(0) if shared is not None else 0, TOP_K=top_k,
        NUM_SHARED=shared.shape[0] if shared is not None else 0, BLOCK_H=block_h, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=4,
    )
    return out


def fused_moe_reference(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, activation: int = SILU, w_gate_up_scale: torch.Tensor | None = None,
                        w_down_scale: torch.Tensor | None = None, act_group: int | None = None,
                        shared_experts: SharedExperts | None = None) -> torch.Tensor:
    """fused_moe in plain torch, one expert at a time, in float32; act(gate) * up is rounded to hidden's dtype,
    where the kernel keeps it between its two products. FP8 stacks are dequantized; with `act_group` (fused_moe's
    W8A8 way, its launch's block_n) the tokens go through quantize_rows' cast first, and the act rows through the
    same cast per group of act_group columns. Experts from E on are `shared_experts`' columns."""
    _check(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    _check_shared(shared_experts, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    inter = w_down.shape[2]
    x = hidden.float()
    if act_group is not None:
        x = _dequantize(*quantize_rows_reference(x))
    pair_out = torch.zeros(*topk_ids.shape, hidden.shape[1], dtype=torch.float32, device=hidden.device)  # [T, K, H]
    for expert in topk_ids.unique().tolist():
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)
        if expert >= w_down.shape[0] and shared_experts is None:
            raise ValueError(f"fused_moe_reference: expert {expert} is past the stacks' {w_down.shape[0]} experts, "
                             "and no shared experts were given")
        if expert < w_down.shape[0]:
            gate_up, down = w_gate_up[expert].float(), w_down[expert].float()
            if w_gate_up_scale is not None:
                gate_up, down = _dequantize(gate_up, w_gate_up_scale[expert]), _dequantize(down, w_down_scale[expert])
        else:
            gate_up, down = _shared_expert(shared_experts, expert - w_down.shape[0], inter)
        gate_up = x[token] @ gate_up.T
        gate = gate_up[:, :inter]
        gate = F.gelu(gate, approximate="tanh") if activation == GELU_TANH else F.silu(gate)
        act = (gate * gate_up[:, inter:]).to(hidden.dtype).float()
        if act_group is not None:
            act = _cast_in_groups(act, act_group)
        pair_out[token, choice] = (act @ down.T) * topk_weights[token, choice, None].float()
    return pair_out.sum(1).to(hidden.dtype)


def _shared_expert(shared: SharedExperts, chunk: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared expert `chunk` as a routed one's [2I, H] and [H, I] weights, dequantized in float32."""
    gate_up, down = shared.w_gate_up.float(), shared.w_down.float()
    if shared.w_gate_up_scale is not None:
        gate_up, down = _dequantize(gate_up, shared.w_gate_up_scale), _dequantize(down, shared.w_down_scale)
    count = shared.count(inter)
    rows = torch.arange(chunk * inter, (chunk + 1) * inter, device=gate_up.device)
    return gate_up[torch.cat([rows, rows + count * inter])], down[:, chunk * inter:(chunk + 1) * inter]


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., N, K] times its scales [..., N, G], each over K / G columns, in float32 (a trailing [N] scale: G 1)."""
    scale = scale.float().reshape(*q.shape[:-1], -1)
    return (q.float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)


def _cast_in_groups(rows: torch.Tensor, group: int) -> torch.Tensor:
    """rows [M, K] through quantize_rows' cast per group of `group` columns (the last one ragged), back in float32."""
    m, k = rows.shape
    groups = triton.cdiv(k, group)
    padded = F.pad(rows, (0, groups * group - k)).reshape(m * groups, group)  # zeros move no group's maximum
    return _dequantize(*quantize_rows_reference(padded)).reshape(m, groups * group)[:, :k]
