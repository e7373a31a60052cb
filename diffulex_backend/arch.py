"""The normalized architecture that every model family parses its config.json into. A leaf: the layers, the
tensor-parallel plan and the tokenizer read it without importing the families."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RouterScore(enum.Enum):
    """How a mixture-of-experts router turns its logits into expert scores."""
    SOFTMAX = "softmax"  # Qwen3-MoE, so SDAR-MoE
    SIGMOID = "sigmoid"  # LLaDA2 (DeepSeek-V3 style)


@dataclass(frozen=True)
class ModelArch:
    model_name: str  # the registered family: "llada", "dream", "sdar", ...
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per gate/up projection of the gated MLP
    vocab_size: int  # rows of the embedding table and of the output head
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mask_token_id: int | None
    eos_token_ids: tuple[int, ...]
    shifted: bool  # position i predicts token i + 1 (Dream); else position i predicts token i
    block_size: int | None  # the block size a block-diffusion model was trained with (SDAR)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2, so Dream)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, so SDAR)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates (the first ones)
    # Mixture of experts; num_experts 0 is a dense model and the other MoE fields are then unused.
    num_experts: int = 0  # routed experts of each MoE layer
    num_experts_per_tok: int = 0  # routed experts each token goes through
    moe_intermediate_size: int = 0  # per gate/up projection of one expert
    num_shared_experts: int = 0  # a dense MLP of num_shared_experts * moe_intermediate_size every token takes
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is the dense one of intermediate_size (LLaDA2's first)
    num_expert_groups: int = 1  # selection first keeps the best topk_groups groups of experts...
    topk_groups: int = 1  # ...then the best experts inside them
    router_score: RouterScore = RouterScore.SOFTMAX
    router_bias: bool = False  # a per-expert bias added to the scores for selection only (LLaDA2's expert_bias)
    norm_topk_prob: bool = True  # the kept weights are renormalised to sum to one...
    routed_scaling_factor: float = 1.0  # ...then scaled by this
    # config.json keys the family neither reads nor knows to change nothing: the model loads without them (the
    # loader warns), and they stay here so that what the engine reports can name them.
    unrecognized_config_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArch.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelArch.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArch.head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"ModelArch.block_size must be positive or None, got {self.block_size!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"ModelArch.partial_rotary_factor {self.partial_rotary_factor} must give an even number"
                             f" of rotated dims out of head_dim {self.head_dim}, got {self.rotary_dim}")
        if self.num_experts:
            self._validate_moe()
        for name, token in [("mask_token_id", self.mask_token_id)] + [("eos_token_ids", t) for t in self.eos_token_ids]:
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"ModelArch.{name} {token} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_expert_groups",
                     "topk_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArch.{name} must be a positive int for a MoE model, got {value!r}")
        if self.num_shared_experts < 0:
            raise ValueError(f"ModelArch.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.num_experts % self.num_expert_groups:
            raise ValueError(f"ModelArch.num_experts ({self.num_experts}) must be a multiple of num_expert_groups"
                             f" ({self.num_expert_groups})")
        if self.topk_groups > self.num_expert_groups:
            raise ValueError(f"ModelArch.topk_groups ({self.topk_groups}) exceeds num_expert_groups"
                             f" ({self.num_expert_groups})")
        kept = self.topk_groups * (self.num_experts // self.num_expert_groups)
        if self.num_experts_per_tok > kept:
            raise ValueError(f"ModelArch.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {kept} experts"
                             f" of the {self.topk_groups} kept groups")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"ModelArch.routed_scaling_factor must be positive, got {self.routed_scaling_factor}")
        if not isinstance(self.router_score, RouterScore):
            raise ValueError(f"ModelArch.router_score must be a RouterScore, got {self.router_score!r}")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"ModelArch.dense_layers {self.dense_layers} must name layers in [0, {self.num_layers})")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate, up and down."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def expected_touched_experts(self, num_tokens: int) -> float:
        """The mean number of distinct experts that num_tokens tokens reach in one MoE layer if each token's
        num_experts_per_tok choices were uniform: E (1 - (1 - K / E)^T). A 32-token block of LLaDA2-mini (E 256,
        K 8) reaches about 163."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.num_experts_per_tok / self.num_experts) ** num_tokens)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """The exact number of parameters, for FLOP and byte floors."""
        return self._params(routed_experts=self.num_experts)

    def num_active_params(self) -> int:
        """The parameters one token's forward multiplies by: the routed experts it takes, not all of them."""
        return self._params(routed_experts=self.num_experts_per_tok)

    def _params(self, routed_experts: int) -> int:
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.qkv_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attention += 2 * self.head_dim
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_mlp = (routed_experts + self.num_shared_experts) * self.expert_params
        moe_mlp += self.num_experts * self.hidden_size  # the router
        if self.router_bias:
            moe_mlp += self.num_experts
        norms = 2 * self.hidden_size
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        mlps = self.num_moe_layers * moe_mlp + (self.num_layers - self.num_moe_layers) * dense_mlp
        return embedding + self.num_layers * (attention + norms) + mlps + self.hidden_size + head
