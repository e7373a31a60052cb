"""The decoder-only transformer that every family is, and the map from its parameters to checkpoint names.

A family subclass says two things: how its config.json becomes a `ModelArch` (`parse_config`), and the names
its weights have in the released safetensors (`TOP_WEIGHTS`, `LAYER_PREFIX`, `LAYER_WEIGHTS`, and for MoE models
`EXPERT_WEIGHTS`). The loader and the random-checkpoint writer (diffulex_backend/testing) both go through
`checkpoint_layout()`, so the two can never disagree; the writer's config.json for a `ModelArch` is
testing/config_json.py's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.decoder_layer import DecoderLayer
from diffulex_backend.layers.fp8_linear import FP8
from diffulex_backend.layers.lora import LoraBatch
from diffulex_backend.layers.norm import RMSNorm
from diffulex_backend.layers.rotary import rotary_angles
from diffulex_backend.layers.self_attention import AttentionFn
from diffulex_backend.arch import ModelArch
from diffulex_backend.tensor_parallel import TensorParallel


class FusedPart(enum.Enum):
    """Which rows of a fused parameter a separate checkpoint tensor fills."""
    Q = "q"
    K = "k"
    V = "v"
    GATE = "gate"  # the first half of a gate_up parameter's rows
    UP = "up"  # the second half


class Split(enum.Enum):
    """How tensor parallelism divides a parameter among ranks (tensor_parallel.py)."""
    REPLICATED = "replicated"
    QKV = "qkv"  # rows: each part (q, k, v) keeps this rank's heads
    GATE_UP = "gate_up"  # rows: each half keeps this rank's intermediate columns
    ROW = "row"  # columns (the input dimension): o_proj and down_proj
    VOCAB = "vocab"  # rows of the vocabulary


# Parameter name suffix -> split; anything else is replicated (norms, the router).
SPLITS = {
    "qkv_proj.weight": Split.QKV, "qkv_proj.bias": Split.QKV, "gate_up_proj.weight": Split.GATE_UP,
    "w_gate_up": Split.GATE_UP, "o_proj.weight": Split.ROW, "down_proj.weight": Split.ROW, "w_down": Split.ROW,
    "embed_tokens.weight": Split.VOCAB, "lm_head.weight": Split.VOCAB,
}

# One copy of the loader: rows of the (rank's) parameter <- the index of the checkpoint tensor; () is all of it.
Piece = tuple[slice, tuple[slice, ...]]


@dataclass(frozen=True)
class CheckpointWeight:
    param: str  # name in this module's state dict
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    expert: int | None  # for stacked experts [E, ...]: the index of this expert in the parameter
    # What this rank copies from the tensor; () when it holds none of it (another rank's expert).
    pieces: tuple[Piece, ...]

    @property
    def rows(self) -> slice:
        """The parameter rows a whole checkpoint tensor fills: a model of one rank, where each tensor is one piece."""
        (rows, source), = self.pieces
        assert source == (), "rows is defined for a model of one rank"
        return rows

    def target(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The view of the parameter that this checkpoint tensor fills (a model of one rank)."""
        param = params[self.param]
        return (param if self.expert is None else param[self.expert])[self.rows]


@dataclass(frozen=True)
class TokenMerge:
    """The engine's token-merge setting (dmax): fixed for its lifetime, so a CUDA graph may capture it."""

    mask_token_id: int
    mode: str  # "dmax_topk" or "iter_smooth_topk" (config.TOKEN_MERGE_MODES)
    renormalize: bool
    top_k: int  # K: tokens mixed per row


@dataclass(frozen=True)
class RowInput:
    """A forward input of one value per token row beside the ids, passed by keyword: its shape past the row, and
    its dtype (a CUDA graph holds a static buffer of it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SoftInputs:
    """Soft inputs (dmax): rows of the forward fed as a mixture of embeddings instead of their token's embedding."""

    ids: torch.Tensor  # [T, K] int64: the tokens mixed into each row
    coef: torch.Tensor  # [T, K + 1] float32: their probabilities p_k, then the row's merge weight w (0: hard)
    merge: TokenMerge


def soft_embeddings(embed: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, soft: SoftInputs
                    ) -> torch.Tensor:
    """[T, hidden]: each row's input embedding, where `embed` looks up rows of the embedding table. With
    e = embed(input_id), e_k = embed(ids_k), m = embed(mask) and r = max(0, 1 - sum p_k):
      dmax_topk:        x = sum_k p_k e_k + r m, rescaled (renormalize) to the norm sum_k p_k |e_k| + r |m|;
                        fed as e + w (x - e), so w = 1 feeds DMax's mixture and w = 0 the token itself;
      iter_smooth_topk: fed as e + w sum_k p_k e_k.
    Batched over rows, no host sync: it runs inside a CUDA graph. Computed in float32 at least."""
    hard = embed(input_ids)  # [T, hidden]
    work = torch.promote_types(hard.dtype, torch.float32)
    probs, weight = soft.coef[:, :-1].to(work), soft.coef[:, -1:].to(work)  # [T, K], [T, 1]
    topk = embed(soft.ids).to(work)  # [T, K, hidden]
    weighted = (probs[:, :, None] * topk).sum(1)  # [T, hidden]
    if soft.merge.mode == "iter_smooth_topk":
        return (hard.to(work) + weight * weighted).to(hard.dtype)
    mask = embed(soft.ids.new_full((1,), soft.merge.mask_token_id))[0].to(work)  # [hidden]
    rest = (1 - probs.sum(1, keepdim=True)).clamp_min(0)  # [T, 1]
    mixed = weighted + rest * mask
    if soft.merge.renormalize:
        target = (probs * topk.norm(dim=-1)).sum(1, keepdim=True) + rest * mask.norm()
        mixed = mixed * (target / mixed.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return (hard.to(work) + weight * (mixed - hard.to(work))).to(hard.dtype)


def _shard(split: Split, part: FusedPart | None, local: tuple[int, ...], arch: ModelArch, tp: TensorParallel
           ) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    """The checkpoint tensor's full shape and the pieces of it that land in a parameter of shape `local` (one
    expert's, for stacked experts) on this rank. On one rank each tensor is one piece, copied whole."""
    if split is Split.VOCAB:
        rows = tp.vocab_rows(arch.vocab_size)
        kept = min(rows.stop, arch.vocab_size) - rows.start
        source = (slice(rows.start, rows.start + kept),) if tp.size > 1 else ()
        return (arch.vocab_size, *local[1:]), ((slice(0, kept), source),)
    if split is Split.ROW:
        columns = local[-1]
        source = (slice(None), slice(tp.rank * columns, (tp.rank + 1) * columns)) if tp.size > 1 else ()
        return (*local[:-1], columns * tp.size), ((slice(0, local[0]), source),)
    if split is Split.REPLICATED:
        return local, ((slice(0, local[0]), ()),)
    # QKV or GATE_UP: the parameter's rows are parts, each holding this rank's share of the full part:
    # (part, rows of the full part, the share's rows in it).
    if split is Split.QKV:
        heads, kv, d = tp.share(arch.num_heads), tp.kv_heads(arch), arch.head_dim
        q_share, kv_share = slice(heads.start * d, heads.stop * d), slice(kv.start * d, kv.stop * d)
        parts = [(FusedPart.Q, arch.q_size, q_share), (FusedPart.K, arch.kv_size, kv_share),
                 (FusedPart.V, arch.kv_size, kv_share)]
    else:
        half = local[0] // 2
        share = slice(tp.rank * half, (tp.rank + 1) * half)
        parts = [(FusedPart.GATE, half * tp.size, share), (FusedPart.UP, half * tp.size, share)]
    pieces, at, offset = [], 0, 0
    for name, full_rows, share in parts:
        size = share.stop - share.start
        if part in (None, name):
            base = offset if part is None else 0  # a tensor that is already fused holds every part, in order
            pieces.append((slice(at, at + size), (slice(base + share.start, base + share.stop),)))
        at += size
        offset += full_rows
    full_shape = (offset if part is None else next(f for n, f, _ in parts if n is part), *local[1:])
    if tp.size == 1:
        return full_shape, ((slice(0, at) if part is None else pieces[0][0], ()),)
    return full_shape, tuple(pieces)


class DecoderLM(nn.Module):
    # Set by each family.
    MODEL_TYPES: tuple[str, ...] = ()  # config.json "model_type" values that name this family
    ARCHITECTURES: tuple[str, ...] = ()  # config.json "architectures" entries that name this family
    # The decoding strategy the engine uses for this family when the settings name none.
    DEFAULT_STRATEGY: str = "multi_bd"
    TOP_WEIGHTS: dict[str, str] = {}  # checkpoint name -> parameter name, outside the layers
    LAYER_PREFIX: str = ""  # checkpoint prefix of layer N, with {} for N
    LAYER_WEIGHTS: dict[str, tuple[str, FusedPart | None]] = {}  # suffix -> (parameter suffix, part)
    # MoE layers' experts, stored one at a time: suffix with {} for the expert -> (stacked parameter suffix, part)
    EXPERT_WEIGHTS: dict[str, tuple[str, FusedPart | None]] = {}
    # ModelArch fields a random test checkpoint of this family takes unless told otherwise (the MoE routing).
    RANDOM_ARCH: dict = {}
    # Run `layers.fused_forward` (Triton kernels, CUDA only) instead of the torch modules; the engine turns it
    # on when the Triton attention backend is selected.
    fused_kernels: bool = False
    # The head sizes the Triton path serves (the attention kernel, and the RoPE and K/V store kernels of the fused
    # forward), and whether the fused forward, the sampler kernel and CUDA graphs come with the kernel attention.
    KERNEL_HEAD_DIMS = (64, 128)
    FUSED_FORWARD = True

    def row_inputs(self) -> dict[str, RowInput]:
        """The forward's keyword inputs of one value per row, beside the ids: none here."""
        return {}

    def replays_graphs(self) -> bool:
        """Whether a step's forward may replay a CUDA graph (unless enforce_eager): the fused forward, whose kernels
        read every length from the device."""
        return self.fused_kernels

    def __init__(self, arch: ModelArch, attention_fn: AttentionFn, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.arch, self.tp = arch, tp
        vocab_rows = tp.vocab_rows(arch.vocab_size)
        self.vocab_start, local_vocab = vocab_rows.start, vocab_rows.stop - vocab_rows.start
        self.embed_tokens = nn.Embedding(local_vocab, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, attention_fn, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, local_vocab, bias=False)

    # --- what a family provides ---------------------------------------------------------------------------

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        """config.json -> ModelArch. Raises ValueError naming `path` and the key on any problem."""
        raise NotImplementedError

    @classmethod
    def recognises(cls, config: dict) -> bool:
        """Whether config.json names this family by something other than its "model_type" (which the loader
        checks first, for every family): by default, an "architectures" entry."""
        return any(a in cls.ARCHITECTURES for a in config.get("architectures") or [])

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def empty(cls, arch: ModelArch, attention_fn: AttentionFn, *, dtype: torch.dtype, device,
              tp: TensorParallel = TensorParallel()) -> "DecoderLM":
        """The model (this rank's share of it) with uninitialized parameters, allocated once, directly on `device`
        in `dtype`."""
        with torch.device("meta"):
            model = cls(arch, attention_fn, tp)
            model.to(dtype)
            for module in model.modules():  # parameters a layer keeps in float32 at least (a router's bias)
                for name in getattr(module, "FLOAT32_PARAMS", ()):
                    param = getattr(module, name)
                    if param is not None:
                        setattr(module, name, nn.Parameter(param.to(torch.promote_types(dtype, torch.float32))))
        # Inference only: no parameter takes part in autograd.
        model = model.to_empty(device=device).requires_grad_(False)
        kept = arch.vocab_size - model.vocab_start
        for table in (model.embed_tokens, model.lm_head):  # the last rank's padding rows, which no checkpoint fills
            if table is not None and kept < table.weight.shape[0]:
                table.weight[kept:].zero_()
        return model

    def checkpoint_layout(self) -> dict[str, CheckpointWeight]:
        """Every checkpoint tensor name of this architecture, its shape, and the pieces of it this rank holds."""
        arch, tp = self.arch, self.tp
        params = dict(self.named_parameters())
        # checkpoint name -> (parameter, part, expert)
        names: dict[str, tuple[str, FusedPart | None, int | None]] = {
            k: (v, None, None) for k, v in self.TOP_WEIGHTS.items()}
        for layer in range(arch.num_layers):
            prefix = self.LAYER_PREFIX.format(layer)
            for suffix, (param, part) in self.LAYER_WEIGHTS.items():
                names[prefix + suffix] = (f"layers.{layer}.{param}", part, None)
            if arch.is_moe_layer(layer):
                for suffix, (param, part) in self.EXPERT_WEIGHTS.items():
                    for expert in range(arch.num_experts):
                        names[prefix + suffix.format(expert)] = (f"layers.{layer}.{param}", part, expert)
        held = tp.experts(arch.num_experts)
        layout = {}
        for name, (param, part, expert) in names.items():
            if param not in params:  # e.g. lm_head when tied, q_norm without qk_norm, a dense MLP in a MoE layer
                continue
            local = params[param] if expert is None else params[param][0]
            split = next((v for k, v in SPLITS.items() if param.endswith(k)), Split.REPLICATED)
            # With expert parallelism a rank holds whole experts: no share of each.
            ways = TensorParallel() if expert is not None and tp.expert_parallel else tp
            shape, pieces = _shard(split, part, tuple(local.shape), arch, ways)
            if expert is not None and not held.start <= expert < held.stop:
                expert, pieces = None, ()
            elif expert is not None:
                expert -= held.start
            layout[name] = CheckpointWeight(param, shape, expert, pieces)
        covered = {w.param for w in layout.values()}
        # An fp8 weight's scale (quantization.py) is named after the weight's checkpoint name by its scheme.
        covered |= {p + "_scale" for p in covered if p + "_scale" in params}
        assert covered == set(params), f"parameters without a checkpoint name: {sorted(set(params) - covered)}"
        return layout

    # --- the interface the runner calls -------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        kv_cache: torch.Tensor | None,  # [2, num_layers, num_pages, page_size, kv_heads, head_dim]
        soft: SoftInputs | None = None,  # rows fed as embedding mixtures (dmax); None: every row is its token
        lora: LoraBatch | None = None,  # which rows take which adapter (layers/lora.py); None: no adapter
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        if self.fused_kernels:
            from diffulex_backend.layers.fused_forward import fused_forward  # imports Triton: only when asked
            from diffulex_backend.layers.lora import device_segments

            segments = None if lora is None else device_segments(lora, input_ids.device)
            return fused_forward(self, input_ids, positions, meta, kv_cache, soft, segments)
        cos, sin = rotary_angles(positions, self.arch.rotary_dim, self.arch.rope_theta,
                                 torch.promote_types(self.embed_tokens.weight.dtype, torch.float32))
        hidden = self.input_embeddings(input_ids, soft)
        for index, layer in enumerate(self.layers):
            k_cache = v_cache = None
            if kv_cache is not None:
                k_cache, v_cache = kv_cache[0, index], kv_cache[1, index]
            hidden = layer(hidden, cos, sin, meta, k_cache, v_cache, lora)
        return self.norm(hidden)

    def input_embeddings(self, input_ids: torch.Tensor, soft: SoftInputs | None) -> torch.Tensor:  # [T, hidden]
        if soft is None:
            return self.embed(input_ids)
        return soft_embeddings(self.embed, input_ids, soft)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        """Rows of the embedding table. Under tensor parallelism each rank holds a share of the rows: it looks up
        the ids that fall in its share, zeros for the rest, and the sum over ranks is every id's row."""
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        rows = self.embed_tokens(torch.where(held, local, 0)).masked_fill(~held[..., None], 0)
        return self.tp.all_reduce(rows)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """The logits; under tensor parallelism, with `gather` off, this rank's columns only (from vocab_start, the
        last rank's ending in padding columns)."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if head.dtype == FP8:  # fp8_lm_head
            logits = self.lm_head(hidden)
        elif self.fused_kernels:
            from diffulex_kernels.linear import linear  # the weight-streaming kernel at a few rows

            logits = linear(hidden, head)
        else:
            logits = F.linear(hidden, head)
        if self.tp.size == 1 or not gather:
            return logits
        # Every rank gets the whole rows, so each samples the same tokens as the others without a broadcast.
        return self.tp.gather_columns(logits)[:, :self.arch.vocab_size]
