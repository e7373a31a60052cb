"""DiffusionGemma (google/diffusiongemma-*): a Gemma-4 text decoder that denoises a canvas of random tokens.

Released as `DiffusionGemmaForBlockDiffusion` (config.json `model_type` "diffusion_gemma", the text model's keys
under `text_config`). Transformers runs it as an encoder and a decoder that share every weight: the encoder reads
the prompt and each finished canvas causally and fills the KV cache; the decoder reads the cache and attends
bidirectionally inside the canvas, writing nothing. Here both are one model: rows fed causally (block id = their
position) are the encoder's, the canvas rows (one block id) the decoder's, and only the decoder's rows take the
self-conditioning input. The checkpoint stores the shared weights once, under `model.decoder.`, and the encoder's
layer scalars (buffers, which transformers does not tie) under `model.encoder.language_model.`; its vision tower
is left unread. config.json comes from testing/diffusion_gemma_checkpoint.py for random checkpoints: ModelArch does
not describe this family, so checkpoint.py's writer does not write it.

The parts, from transformers' modeling_diffusion_gemma.py and Diffulex's diffusion_gemma.py:
- attention: `layer_types` alternates sliding-window and full layers. Full layers have their own head size
  (`global_head_dim`) and KV-head count (`num_global_key_value_heads`), and no v_proj: V is the k_proj output
  (attention_k_eq_v). Q and K are RMS-normed with a weight, V without one; the attention scale is 1.
- RoPE per layer type (`rope_parameters`): sliding layers rotate the whole head; full layers use the
  "proportional" RoPE: frequencies over the full head size, with only the first partial_rotary_factor share of
  them nonzero.
- layers: sandwich norms (input/post-attention, pre/post-feedforward), a gelu-tanh gated MLP, a MoE block beside
  it when `num_experts` is set, and a learned scalar on the layer's output.
- the embedding is scaled by sqrt(hidden_size); the head is tied to it; the final logits are soft-capped:
  cap * tanh(logits / cap).
- self-conditioning: a canvas row's input is post_norm(e + down(gelu(gate(n)) * up(n))), n = pre_norm(s), where
  s is the soft embedding of the previous denoising step's distribution (zero at a canvas's first step).

Where this does not reuse the shared layers: the decoder layer (sandwich norms, layer scalar, a MoE beside the
MLP) and the attention (no fused qkv, K = V on full layers, a window, two head shapes) are written here; RMSNorm
and the rotate-half RoPE are the shared ones. On a GPU the attention is the Triton kernel (`attention_backend` auto
or triton), which takes the window and both head sizes; `window_attention` below is its torch reference and the CPU
path. Each norm is the Triton norm kernel on a GPU, one launch where the torch form takes half a dozen. The fused
forward, whose kernels are built for DecoderLM's layers, does not serve this family.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_backend.attention import AttentionMetadata, paged_attention_reference
from diffulex_backend.layers.norm import RMSNorm
from diffulex_backend.layers.rotary import apply_rotary
from diffulex_backend.arch import ModelArch
from diffulex_backend.models.decoder_lm import CheckpointWeight, DecoderLM, RowInput
from diffulex_backend.models.hf_config import ConfigReader
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.tensor_parallel import TensorParallel

SLIDING, FULL = "sliding_attention", "full_attention"
PREFIX = "model.decoder."
ENCODER_PREFIX = "model.encoder.language_model."

# text_config keys read or checked here, and those that change no forward pass.
TEXT_CONFIG_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads", "hidden_activation",
    "max_position_embeddings", "rms_norm_eps", "pad_token_id", "eos_token_id", "bos_token_id",
    "tie_word_embeddings", "rope_parameters", "attention_bias", "sliding_window", "layer_types",
    "final_logit_softcapping", "use_bidirectional_attention", "num_experts", "top_k_experts",
    "moe_intermediate_size", "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp",
    "enable_moe_block", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "per_layer_config",
    # Training only.
    "attention_dropout", "initializer_range",
})
TOP_CONFIG_KEYS = frozenset({
    "text_config", "vision_config", "canvas_length", "boi_token_id", "eoi_token_id", "image_token_id",
    "initializer_range", "tie_word_embeddings", "self_conditioning_size", "eos_token_id", "pad_token_id",
    "bos_token_id",
})


@dataclass(frozen=True)
class DenoiseSchedule:
    """The uniform-diffusion sampler's settings: generation_config.json's, else transformers' defaults."""

    max_denoising_steps: int = 48
    t_min: float = 0.4  # temperature at the last step
    t_max: float = 0.8  # temperature at the first step
    # The sampler keeps the lowest-entropy tokens whose entropies, less the largest of them, sum under this.
    entropy_bound: float = 0.1
    stability_threshold: int = 1  # steps the argmax canvas must repeat...
    confidence_threshold: float = 0.005  # ...with a mean entropy under this, to end the canvas early

    def temperature(self, step: int) -> float:
        """Step 0 is the first: transformers counts the steps remaining, N down to 1."""
        remaining = self.max_denoising_steps - step
        return self.t_min + (self.t_max - self.t_min) * remaining / self.max_denoising_steps


@dataclass(frozen=True)
class DiffusionGemmaArch(ModelArch):
    """ModelArch's fields describe the sliding layers (num_kv_heads, head_dim); these the rest."""

    layer_types: tuple[str, ...] = ()
    sliding_window: int = 512
    global_head_dim: int = 512
    num_global_kv_heads: int = 1
    sliding_rope_theta: float = 10000.0
    global_rope_theta: float = 1e6
    global_rotary_factor: float = 0.25
    final_logit_softcapping: float | None = 30.0
    canvas_length: int = 256
    top_k_experts: int = 0
    schedule: DenoiseSchedule = DenoiseSchedule()

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of a layer."""
        if self.layer_types[layer] == FULL:
            return self.num_global_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    @functools.cached_property
    def kv_columns(self) -> tuple[slice, ...]:
        """Each layer's columns of a cache row, which holds one token's K (or V) of every layer at its own width."""
        widths = [h * d for h, d in map(self.layer_shape, range(self.num_layers))]
        return tuple(slice(end - width, end) for width, end in zip(widths, itertools.accumulate(widths)))

    @property
    def kv_width(self) -> int:
        """Values one token's K (or V) takes over every layer: the cache's row width."""
        return self.kv_columns[-1].stop

    def _params(self, routed_experts: int) -> int:
        total = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        h = self.hidden_size
        for layer in range(self.num_layers):
            kvh, d = self.layer_shape(layer)
            kv = kvh * d * (1 if self.layer_types[layer] == FULL else 2)
            # q and o, k (and v), the MLP, q/k norms, four sandwich norms, the decoder's and encoder's scalars
            total += h * (self.num_heads * d) * 2 + h * kv + 3 * h * self.intermediate_size + 2 * d + 4 * h + 2
            if self.num_experts:  # experts, router and its scales, three more norms
                total += routed_experts * 3 * h * self.moe_intermediate_size + self.num_experts * (h + 1) + 4 * h
        return total + h + h + 3 * h * self.intermediate_size  # final norm; self-conditioning's norm and MLP


def _rope(reader: ConfigReader, layer_type: str, path) -> tuple[float, float]:
    """(theta, rotary factor) of a layer type, refusing RoPE kinds this file does not build."""
    params = reader.config.get("rope_parameters") or {}
    entry = params.get(layer_type) if isinstance(params, dict) else None
    default = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}[layer_type]
    entry = default if entry is None else entry
    kind = entry.get("rope_type", "default")
    allowed = "default" if layer_type == SLIDING else "proportional"
    if kind != allowed:
        raise ValueError(f"{path}: config key 'rope_parameters' gives {layer_type} rope_type {kind!r}; only "
                         f"{allowed!r} is supported there")
    if entry.get("factor", 1.0) != 1.0:
        raise ValueError(f"{path}: config key 'rope_parameters' gives {layer_type} a scaling factor "
                         f"{entry['factor']!r}; only 1.0 (no RoPE scaling) is supported")
    factor = float(entry.get("partial_rotary_factor", 1.0))
    return float(entry.get("rope_theta", default["rope_theta"])), factor


def _full_layer_shape(r: ConfigReader, types: list[str], path) -> tuple[int, int]:
    """(head size, KV heads) of the full layers. Released files say `global_head_dim` and
    `num_global_key_value_heads`; transformers 5 writes them per layer, as `per_layer_config` {index: {"head_dim",
    "num_key_value_heads"}}, and drops the two keys."""
    head_dim = r.int("global_head_dim", default=512)
    kv_heads = r.int("num_global_key_value_heads", default=None, allow_none=True) or r.int("num_key_value_heads")
    per_layer = r.config.get("per_layer_config")
    if per_layer is None:
        return head_dim, kv_heads
    if not isinstance(per_layer, dict):
        raise ValueError(f"{path}: config key 'per_layer_config' must be an object, got {per_layer!r}")
    shapes = set()
    for index, entry in per_layer.items():
        layer = int(index) if str(index).isdigit() else -1
        if not 0 <= layer < len(types) or types[layer] != FULL or not isinstance(entry, dict) \
                or not set(entry) <= {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"{path}: config key 'per_layer_config' entry {index!r}: {entry!r}; only full_attention "
                             "layers may set head_dim and num_key_value_heads")
        shapes.add((entry.get("head_dim", head_dim), entry.get("num_key_value_heads", kv_heads)))
    if len(shapes) > 1:
        raise ValueError(f"{path}: config key 'per_layer_config' gives full_attention layers different shapes "
                         f"{sorted(shapes)}; one shape for all of them is supported")
    return shapes.pop() if shapes else (head_dim, kv_heads)


def read_schedule(directory: Path) -> DenoiseSchedule:
    """generation_config.json's sampler settings, where the checkpoint has the file."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return DenoiseSchedule()
    try:
        gen = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    fields = {}
    for key in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold"):
        if gen.get(key) is not None:
            fields[key] = gen[key]
    bound = (gen.get("sampler_config") or {}).get("entropy_bound")
    if bound is not None:
        fields["entropy_bound"] = bound
    schedule = DenoiseSchedule(**fields)
    if not (isinstance(schedule.max_denoising_steps, int) and schedule.max_denoising_steps > 0
            and 0 <= schedule.t_min < schedule.t_max and schedule.entropy_bound > 0
            and isinstance(schedule.stability_threshold, int) and schedule.stability_threshold >= 0):
        raise ValueError(f"{path}: sampler settings {dataclasses.asdict(schedule)} are out of range "
                         "(max_denoising_steps > 0, 0 <= t_min < t_max, entropy_bound > 0, stability_threshold >= 0)")
    return schedule


def on_norm_kernel(x: torch.Tensor) -> bool:
    """Whether a norm of x runs as the Triton kernel: on a GPU, where the torch form's half a dozen launches a norm,
    eleven norms a layer, are most of a small batch's forward outside its matrix products. Float64 stays torch."""
    return x.is_cuda and x.dtype != torch.float64


def kernel_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) (* weight) over the last dimension, as one launch: the statistics and the product in float32,
    rounded once."""
    from diffulex_kernels import rmsnorm  # imports Triton: only on a GPU

    return rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma's V norm, self-conditioning's post norm, the router's input norm)."""
    if on_norm_kernel(x):
        return kernel_norm(x.contiguous(), None, eps)
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """The shared RMSNorm, as one kernel launch on a GPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_norm_kernel(x):
            return kernel_norm(x.contiguous(), self.weight, self.eps)
        return super().forward(x)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
                     v_cache: torch.Tensor | None, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """The paged attention of attention.py with scale 1 and an optional window: a query of block id b sees keys
    at positions >= b - window + 1 (a causal row: the window before it; a canvas row: the window before the
    canvas, and the whole canvas). A sequence's rows start at its context length and no block id is below it,
    so cached tokens before context_len - window + 1 are never read: a sliding layer reads only the pages that
    hold its window. The caches are [pages, page_size, kv_heads, head_dim] views that may be strided (one cache
    row holds every layer), so slots are indexed by (page, offset)."""
    page = None if k_cache is None else k_cache.shape[1]
    if k_cache is not None:
        keep = meta.slot_mapping >= 0
        slots = meta.slot_mapping[keep]
        k_cache[slots // page, slots % page] = k[keep].to(k_cache.dtype)
        v_cache[slots // page, slots % page] = v[keep].to(v_cache.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q_host
    for b in range(meta.num_seqs):
        rows = slice(cu[b], cu[b + 1])
        qs, ks, vs = q[rows], k[rows], v[rows]
        n = qs.shape[0]
        if n == 0:
            continue
        ctx = meta.context_lens_host[b]
        first = 0 if window is None else max(0, ctx - window + 1)  # the first cached position any row may see
        blk = meta.block_ids[rows].long()
        visible = blk[None, :] <= blk[:, None]
        if ctx > first:
            pos = torch.arange(first, ctx, device=q.device)
            pages = meta.page_tables[b][pos // page].long()
            ks = torch.cat([k_cache[pages, pos % page].to(ks.dtype), ks])
            vs = torch.cat([v_cache[pages, pos % page].to(vs.dtype), vs])
            visible = torch.cat([visible.new_ones(n, ctx - first), visible], dim=1)
        if window is not None:
            key_pos = torch.arange(first, ctx + n, device=q.device)
            visible = visible & (key_pos[None, :] > blk[:, None] - window)
        acc = torch.promote_types(qs.dtype, torch.float32)
        qa = qs.transpose(0, 1).to(acc)
        ka = ks.transpose(0, 1).to(acc).repeat_interleave(group, dim=0)
        va = vs.transpose(0, 1).to(acc).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(qa, ka, va, attn_mask=visible, scale=1.0)
        out[rows] = o.transpose(0, 1).to(out.dtype)
    return out


class GemmaAttention(nn.Module):
    def __init__(self, arch: DiffusionGemmaArch, layer: int):
        super().__init__()
        self.full = arch.layer_types[layer] == FULL
        self.num_heads = arch.num_heads
        self.num_kv_heads, self.head_dim = arch.layer_shape(layer)
        self.window = None if self.full else arch.sliding_window
        h = arch.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        # Full layers take V from the k_proj output (attention_k_eq_v).
        self.v_proj = None if self.full else nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps)
        self.eps = arch.rms_norm_eps
        # Set by the engine: the Triton kernel, or the torch reference (which stands for window_attention here).
        self.attention_fn = None

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        raw_k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        raw_v = raw_k if self.v_proj is None else self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        k, v = self.k_norm(raw_k), rms(raw_v, self.eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.attention_fn is None or self.attention_fn is paged_attention_reference:
            out = window_attention(q, k, v, k_cache, v_cache, meta, self.window)
        else:
            out = self.attention_fn(q, k, v, k_cache, v_cache, meta, 1.0, window=self.window)
        return self.o_proj(out.reshape(t, -1))


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaMoE(nn.Module):
    """Gemma-4's router and experts: softmax over the router's logits, the top-k renormalised, each weight then
    scaled per expert. The experts are stacked ([E, 2I, H] gate_up, [E, H, I] down) as the checkpoint holds them.
    On a GPU they run as the fused-MoE kernel with a gelu-tanh gate, in bf16, fp16 or fp32, with no host
    synchronisation per expert; elsewhere (and in float64, which the kernel does not take) the loop over experts, as
    transformers' eager path runs them, is the reference."""

    def __init__(self, arch: DiffusionGemmaArch):
        super().__init__()
        h, e, i = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
        self.proj = nn.Linear(h, e, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.top_k, self.eps = arch.top_k_experts, arch.rms_norm_eps

    def forward(self, x: torch.Tensor, route_from: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(route_from)
        if x.is_cuda and x.dtype != torch.float64:
            from diffulex_kernels.moe import GELU_TANH, fused_moe  # imports Triton: only on a GPU

            return fused_moe(x, self.gate_up_proj, self.down_proj, experts, weights, activation=GELU_TANH)
        return self.experts_loop(x, experts, weights)

    def route(self, route_from: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, K], weights [T, K] float32 at least) of each token."""
        scores = self.proj(rms(route_from, self.eps) * self.scale * route_from.shape[-1] ** -0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, K]
        return experts, (weights / weights.sum(-1, keepdim=True)) * self.per_expert_scale[experts]

    def experts_loop(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(experts == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class GemmaLayer(nn.Module):
    def __init__(self, arch: DiffusionGemmaArch, layer: int):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.attn = GemmaAttention(arch, layer)
        self.mlp = GemmaMLP(h, arch.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        # Transformers ties the encoder's weights to the decoder's but not its buffers: the released file holds the
        # encoder's layer scalar apart, and causal rows take it.
        self.encoder_layer_scalar = nn.Parameter(torch.ones(1))
        if arch.num_experts:
            self.moe = GemmaMoE(arch)
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        else:
            self.moe = None

    def forward(self, x, cos, sin, meta, k_cache, v_cache, canvas):
        attended = self.attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        residual = x + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(residual), residual)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        scalar = self.encoder_layer_scalar if canvas is None else torch.where(
            canvas[:, None], self.layer_scalar, self.encoder_layer_scalar)
        return (residual + self.post_feedforward_layernorm(out)) * scalar


class SelfConditioning(nn.Module):
    def __init__(self, arch: DiffusionGemmaArch):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GemmaMLP(arch.hidden_size, arch.intermediate_size)
        self.eps = arch.rms_norm_eps

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        return rms(embeds + self.mlp(self.pre_norm(soft)), self.eps)


@AutoModelForDiffusionLM.register("diffusion_gemma")
class DiffusionGemmaModel(DecoderLM):
    FAMILY = "diffusion_gemma"
    MODEL_TYPES = ("diffusion_gemma",)
    ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion",)
    DEFAULT_STRATEGY = "diffusion_gemma"
    DECODING_STRATEGIES = ("diffusion_gemma",)  # no mask token: the masked strategies cannot decode it
    IGNORED_WEIGHT_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")  # text only
    # The Triton attention kernel serves both layer kinds (its window, head sizes 256 and 512); the rest of the
    # forward is the torch modules, which a CUDA graph replays (strategies/diffusion_gemma.py).
    KERNEL_HEAD_DIMS = (64, 128, 256, 512)
    FUSED_FORWARD = False

    def __init__(self, arch: DiffusionGemmaArch, attention_fn=None, tp: TensorParallel = TensorParallel()):
        nn.Module.__init__(self)
        if tp.size > 1:
            raise ValueError("model 'diffusion_gemma' runs on one rank: tensor_parallel_size must be 1")
        self.arch, self.tp, self.vocab_start = arch, tp, 0
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(arch, i) for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_conditioning = SelfConditioning(arch)
        self.lm_head = None  # tied to the embedding

    def row_inputs(self) -> dict[str, RowInput]:
        """forward's `canvas` (whether a row is a canvas row) and `soft_embeds` (its self-conditioning input)."""
        return {"canvas": RowInput((), torch.bool),
                "soft_embeds": RowInput((self.arch.hidden_size,), self.embed_tokens.weight.dtype)}

    def replays_graphs(self) -> bool:
        # The torch modules capture as they are once the attention is the Triton kernel: no op of theirs reads a
        # length on the host.
        return all(layer.attn.attention_fn not in (None, paged_attention_reference) for layer in self.layers)

    # --- config.json ---------------------------------------------------------------------------------------
    @classmethod
    def parse_config(cls, config: dict, path) -> DiffusionGemmaArch:
        top = ConfigReader(config, path, cls.FAMILY, TOP_CONFIG_KEYS)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{path}: missing required config key 'text_config' (an object)")
        r = ConfigReader(text, f"{path} (text_config)", cls.FAMILY, TEXT_CONFIG_KEYS)
        r.expect("hidden_activation", ("gelu_pytorch_tanh",), default="gelu_pytorch_tanh")
        r.expect("attention_bias", (False,), default=False)
        r.expect("attention_k_eq_v", (True,), default=True)
        r.expect("use_bidirectional_attention", (None,), default=None)
        # Gemma-4's KV sharing across layers and its per-layer inputs: DiffusionGemma's transformers code drops
        # both, and this file does not build them.
        r.expect("num_kv_shared_layers", (0, None), default=0)
        r.expect("use_double_wide_mlp", (False, None), default=False)
        r.expect("hidden_size_per_layer_input", (0, None), default=None)
        if not top.bool("tie_word_embeddings", default=True) or not r.bool("tie_word_embeddings", default=True):
            raise ValueError(f"{path}: config key 'tie_word_embeddings' is false; only a head tied to the "
                             "embedding is supported")
        layers = r.int("num_hidden_layers")
        types = text.get("layer_types")
        if types is None:  # transformers' default: five sliding layers, then a full one
            types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"{path}: config key 'layer_types' must list {layers} entries of {SLIDING!r} or "
                             f"{FULL!r}, got {types!r}")
        global_head_dim, global_kv_heads = _full_layer_shape(r, types, path)
        sliding_theta, sliding_factor = _rope(r, SLIDING, path)
        if sliding_factor != 1.0:
            raise ValueError(f"{path}: config key 'rope_parameters' gives sliding_attention a partial_rotary_factor"
                             f" {sliding_factor}; only 1.0 is supported there")
        global_theta, global_factor = _rope(r, FULL, path)
        heads = r.int("num_attention_heads")
        head_dim = r.int("head_dim", default=256)
        num_experts = r.int("num_experts", default=None, allow_none=True) or 0
        cap = text.get("final_logit_softcapping", 30.0)
        canvas = top.int("canvas_length", default=256)
        eos = r.token_ids("eos_token_id") or top.token_ids("eos_token_id")
        pad = r.token_id("pad_token_id")
        return DiffusionGemmaArch(
            model_name=cls.FAMILY, hidden_size=r.int("hidden_size"), num_layers=layers, num_heads=heads,
            num_kv_heads=r.int("num_key_value_heads"), head_dim=head_dim,
            intermediate_size=r.int("intermediate_size"), vocab_size=r.int("vocab_size"),
            rope_theta=sliding_theta, rms_norm_eps=r.float("rms_norm_eps", default=1e-6),
            max_position_embeddings=r.int("max_position_embeddings"), tie_word_embeddings=True,
            # No mask token: the pad id marks positions not generated yet and is never fed as a mask.
            mask_token_id=0 if pad is None else pad, eos_token_ids=eos, shifted=False, block_size=canvas,
            qk_norm=True, num_experts=num_experts,
            num_experts_per_tok=r.int("top_k_experts") if num_experts else 0,
            moe_intermediate_size=r.int("moe_intermediate_size") if num_experts else 0,
            layer_types=tuple(types), sliding_window=r.int("sliding_window", default=512),
            global_head_dim=global_head_dim, num_global_kv_heads=global_kv_heads,
            sliding_rope_theta=sliding_theta, global_rope_theta=global_theta, global_rotary_factor=global_factor,
            final_logit_softcapping=None if cap is None else float(cap), canvas_length=canvas,
            top_k_experts=r.int("top_k_experts") if num_experts else 0,
            schedule=read_schedule(Path(path).parent),
            unrecognized_config_keys=top.unrecognized + tuple(f"text_config.{k}" for k in r.unrecognized),
        )

    # --- weights -------------------------------------------------------------------------------------------
    def checkpoint_layout(self) -> dict[str, CheckpointWeight]:
        layout = {}
        for name, param in self.named_parameters():
            if name.endswith("encoder_layer_scalar"):
                layout[ENCODER_PREFIX + name.replace("encoder_layer_scalar", "layer_scalar")] = CheckpointWeight(
                    name, tuple(param.shape), None, ((slice(0, 1), ()),))
                continue
            ckpt = name.replace(".attn.", ".self_attn.").replace("self_conditioning.mlp.", "self_conditioning.")
            if ".moe." in ckpt:
                part = ckpt.rsplit(".", 1)[1]
                ckpt = ckpt.replace(".moe.", ".experts." if part in ("gate_up_proj", "down_proj") else ".router.")
                if part == "proj":
                    ckpt += ".weight"
            rows = param.shape[0]
            layout[PREFIX + ckpt] = CheckpointWeight(name, tuple(param.shape), None, ((slice(0, rows), ()),))
        return layout

    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """One row per token, holding its K (or V) of every layer, each at the layer's own width: the full layers'
        shape (KV heads, head size) differs from the sliding ones', and a cache as wide as the widest layer in
        every layer would leave the narrower layers' share of it unused."""
        return (2, num_pages, page_size, self.arch.kv_width)

    def layer_cache(self, kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V caches: [pages, page_size, kv_heads, head_dim] views of its columns of the rows."""
        columns, shape = self.arch.kv_columns[layer], self.arch.layer_shape(layer)
        return kv_cache[0, :, :, columns].unflatten(-1, shape), kv_cache[1, :, :, columns].unflatten(-1, shape)

    # --- forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids, positions, meta, kv_cache, soft=None, lora=None, canvas: torch.Tensor | None = None,
                soft_embeds: torch.Tensor | None = None):
        """canvas: [T] bool, the rows that take self-conditioning; soft_embeds: [T, hidden], their previous
        step's soft embeddings (zero rows at a canvas's first step)."""
        if soft is not None or lora is not None:
            raise ValueError("model 'diffusion_gemma' takes neither soft inputs nor LoRA adapters")
        arch = self.arch
        work = torch.promote_types(self.embed_tokens.weight.dtype, torch.float32)
        full_rotated = int(arch.global_head_dim * arch.global_rotary_factor)
        angles = {SLIDING: self._angles(positions, arch.head_dim, arch.head_dim, arch.sliding_rope_theta, work),
                  FULL: self._angles(positions, arch.global_head_dim, full_rotated, arch.global_rope_theta, work)}
        hidden = self.embed(input_ids)
        if canvas is not None:
            conditioned = self.self_conditioning(hidden, soft_embeds.to(hidden.dtype))
            hidden = torch.where(canvas[:, None], conditioned, hidden)
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = (None, None) if kv_cache is None else self.layer_cache(kv_cache, index)
            cos, sin = angles[arch.layer_types[index]]
            hidden = layer(hidden, cos, sin, meta, k_cache, v_cache, canvas)
        return self.norm(hidden)

    @staticmethod
    def _angles(positions, head_dim: int, rotary_dim: int, theta: float, dtype):
        """cos, sin [T, head_dim // 2]: frequencies theta^(-2i / head_dim) for the first rotary_dim // 2 pairs and 0
        (no rotation) for the rest, so a partial ("proportional") RoPE still pairs dim i with i + head_dim / 2."""
        exponents = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=dtype) / head_dim
        inv_freq = torch.zeros(head_dim // 2, device=positions.device, dtype=dtype)
        inv_freq[: rotary_dim // 2] = 1.0 / (theta ** exponents)
        angles = positions.to(dtype)[:, None] * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def embed_scale(self) -> torch.Tensor:
        """sqrt(hidden_size) rounded to the weights' dtype, as transformers' scaled embedding rounds it."""
        return torch.tensor(math.sqrt(self.arch.hidden_size), dtype=self.embed_tokens.weight.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids) * self.embed_scale()

    def soft_embeddings(self, probs: torch.Tensor) -> torch.Tensor:  # [N, vocab] -> [N, hidden]
        """The expected scaled embedding under a distribution: the self-conditioning input of the next step."""
        weight = self.embed_tokens.weight
        return (probs.to(weight.dtype) @ weight) * self.embed_scale()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head's product, before the soft cap, in the weights' dtype."""
        return F.linear(hidden, self.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        logits = self.head_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is None:
            return logits
        # In place over the float logits: at the released vocabulary a step's logits are gigabytes.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return logits.div_(cap).tanh_().mul_(cap)
