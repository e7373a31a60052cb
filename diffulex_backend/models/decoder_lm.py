"""The decoder-only transformer that every family is, and the map from its parameters to checkpoint names.

A family subclass says three things: how its config.json becomes a `ModelArch` (`parse_config`), how a
`ModelArch` becomes its config.json (`config_dict`, for the random-checkpoint writer), and the names its
weights have in the released safetensors (`TOP_WEIGHTS`, `LAYER_PREFIX`, `LAYER_WEIGHTS`, and for MoE models
`EXPERT_WEIGHTS`). The loader and the writer both go through `checkpoint_layout()`, so the two can never
disagree.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.decoder_layer import DecoderLayer
from diffulex_backend.layers.lora import LoraBatch
from diffulex_backend.layers.norm import RMSNorm
from diffulex_backend.layers.rotary import rotary_angles
from diffulex_backend.layers.self_attention import AttentionFn
from diffulex_backend.models.arch import ModelArch


class FusedPart(enum.Enum):
    """Which rows of a fused parameter a separate checkpoint tensor fills."""
    Q = "q"
    K = "k"
    V = "v"
    GATE = "gate"  # the first half of a gate_up parameter's rows
    UP = "up"  # the second half


@dataclass(frozen=True)
class CheckpointWeight:
    param: str  # name in this module's state dict
    rows: slice  # rows of `param` (of `param[expert]`) this tensor fills; all rows when the parameter is not fused
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    expert: int | None = None  # for stacked experts [E, ...]: the expert this checkpoint tensor is

    def target(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The view of the parameter that this checkpoint tensor fills."""
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
class SoftInputs:
    """Soft inputs (dmax): rows of the forward fed as a mixture of embeddings instead of their token's embedding."""

    ids: torch.Tensor  # [T, K] int64: the tokens mixed into each row
    coef: torch.Tensor  # [T, K + 1] float32: their probabilities p_k, then the row's merge weight w (0: hard)
    merge: TokenMerge


def soft_embeddings(table: torch.Tensor, input_ids: torch.Tensor, soft: SoftInputs) -> torch.Tensor:
    """[T, hidden]: each row's input embedding. With e = table[input_id], e_k = table[ids_k], m = table[mask]
    and r = max(0, 1 - sum p_k):
      dmax_topk:        x = sum_k p_k e_k + r m, rescaled (renormalize) to the norm sum_k p_k |e_k| + r |m|;
                        fed as e + w (x - e), so w = 1 feeds DMax's mixture and w = 0 the token itself;
      iter_smooth_topk: fed as e + w sum_k p_k e_k.
    Batched over rows, no host sync: it runs inside a CUDA graph. Computed in float32 at least."""
    hard = F.embedding(input_ids, table)  # [T, hidden]
    work = torch.promote_types(table.dtype, torch.float32)
    probs, weight = soft.coef[:, :-1].to(work), soft.coef[:, -1:].to(work)  # [T, K], [T, 1]
    topk = F.embedding(soft.ids, table).to(work)  # [T, K, hidden]
    weighted = (probs[:, :, None] * topk).sum(1)  # [T, hidden]
    if soft.merge.mode == "iter_smooth_topk":
        return (hard.to(work) + weight * weighted).to(hard.dtype)
    mask = table[soft.merge.mask_token_id].to(work)  # [hidden]
    rest = (1 - probs.sum(1, keepdim=True)).clamp_min(0)  # [T, 1]
    mixed = weighted + rest * mask
    if soft.merge.renormalize:
        target = (probs * topk.norm(dim=-1)).sum(1, keepdim=True) + rest * mask.norm()
        mixed = mixed * (target / mixed.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return (hard.to(work) + weight * (mixed - hard.to(work))).to(hard.dtype)


class DecoderLM(nn.Module):
    # Set by each family.
    MODEL_TYPES: tuple[str, ...] = ()  # config.json "model_type" values that name this family
    ARCHITECTURES: tuple[str, ...] = ()  # config.json "architectures" entries that name this family
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

    def __init__(self, arch: ModelArch, attention_fn: AttentionFn):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, attention_fn, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

    # --- what a family provides ---------------------------------------------------------------------------

    @classmethod
    def parse_config(cls, config: dict, path: str | Path) -> ModelArch:
        """config.json -> ModelArch. Raises ValueError naming `path` and the key on any problem."""
        raise NotImplementedError

    @classmethod
    def config_dict(cls, arch: ModelArch) -> dict:
        """ModelArch -> config.json with the family's full released key set."""
        raise NotImplementedError

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def empty(cls, arch: ModelArch, attention_fn: AttentionFn, *, dtype: torch.dtype, device) -> "DecoderLM":
        """The model with uninitialized parameters, allocated once, directly on `device` in `dtype`."""
        with torch.device("meta"):
            model = cls(arch, attention_fn)
            model.to(dtype)
            for module in model.modules():  # parameters a layer keeps in float32 at least (a router's bias)
                for name in getattr(module, "FLOAT32_PARAMS", ()):
                    param = getattr(module, name)
                    if param is not None:
                        setattr(module, name, nn.Parameter(param.to(torch.promote_types(dtype, torch.float32))))
        # Inference only: no parameter takes part in autograd.
        return model.to_empty(device=device).requires_grad_(False)

    def checkpoint_layout(self) -> dict[str, CheckpointWeight]:
        """Every checkpoint tensor name of this architecture and the parameter rows it fills."""
        arch = self.arch
        params = dict(self.named_parameters())
        qkv_rows = {
            FusedPart.Q: slice(0, arch.q_size),
            FusedPart.K: slice(arch.q_size, arch.q_size + arch.kv_size),
            FusedPart.V: slice(arch.q_size + arch.kv_size, arch.q_size + 2 * arch.kv_size),
        }
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
        layout = {}
        for name, (param, part, expert) in names.items():
            if param not in params:  # e.g. lm_head when tied, q_norm without qk_norm, a dense MLP in a MoE layer
                continue
            target = params[param] if expert is None else params[param][expert]
            half = target.shape[0] // 2
            if part in qkv_rows:
                rows = qkv_rows[part]
            elif part is FusedPart.GATE:
                rows = slice(0, half)
            elif part is FusedPart.UP:
                rows = slice(half, 2 * half)
            else:
                rows = slice(0, target.shape[0])
            layout[name] = CheckpointWeight(param, rows, (rows.stop - rows.start, *target.shape[1:]), expert)
        covered = {w.param for w in layout.values()}
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
        # The fused Triton path carries no LoRA delta: a forward with adapters runs the torch modules (with the
        # Triton attention on CUDA), eagerly, outside the CUDA graphs.
        if self.fused_kernels and lora is None:
            from diffulex_backend.layers.fused_forward import fused_forward  # imports Triton: only when asked

            return fused_forward(self, input_ids, positions, meta, kv_cache, soft)
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
            return self.embed_tokens(input_ids)
        return soft_embeddings(self.embed_tokens.weight, input_ids, soft)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.fused_kernels:
            from diffulex_kernels.linear import linear  # the weight-streaming kernel at a few rows

            return linear(hidden, head)
        return F.linear(hidden, head)
