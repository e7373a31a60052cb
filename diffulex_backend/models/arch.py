"""The normalized architecture that every model family parses its config.json into."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    model_name: str  # the registered family: "llada", "dream", "sdar"
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
        for name, token in [("mask_token_id", self.mask_token_id)] + [("eos_token_ids", t) for t in self.eos_token_ids]:
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"ModelArch.{name} {token} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """The exact number of parameters, for FLOP and byte floors."""
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.qkv_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_layers * (attention + mlp + norms) + self.hidden_size + head
