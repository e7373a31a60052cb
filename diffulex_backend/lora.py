"""LoRA adapters in PEFT's layout: read from a local directory, mapped onto the model's fused parameters, then
merged into the weights or stacked for the per-request delta (layers/lora.py).

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as PEFT's `save_pretrained`
writes them. PEFT wraps the Hugging Face model (`base_model.model.` is the wrapper's prefix) and drops the adapter
name from the keys, so the weights of a targeted module `M` are

    base_model.model.M.lora_A.weight   [r, in_features]
    base_model.model.M.lora_B.weight   [out_features, r]

and `M.weight` is that module's name in the released checkpoint. The name mapping is then the family's own
checkpoint table (`checkpoint_layout`): LLaDA's q_proj/k_proj/v_proj/attn_out/ff_proj/up_proj/ff_out and Qwen's
(Dream, SDAR) q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj land in the rows of qkv_proj, o_proj,
gate_up_proj and down_proj they fill. The delta is scale · B · A, scale = lora_alpha / r, or lora_alpha / sqrt(r)
with use_rslora.

Every failure is a `LoraError` naming the file and the key at fault.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .layers.lora import LoraBatch, LoraStack
from .loader import CheckpointError, non_finite_count, past_range, read_json, wider_dtype
from .models.decoder_lm import DecoderLM
from .plan import SeqPlan

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Parameters an adapter may target, with the module and attribute that hold their stack: the attention and dense
# MLP projections. Embeddings, the LM head and MoE experts are not supported.
TARGETS = {
    "attn.qkv_proj.weight": ("attn", "qkv_lora"),
    "attn.o_proj.weight": ("attn", "o_lora"),
    "mlp.gate_up_proj.weight": ("mlp", "gate_up_lora"),
    "mlp.down_proj.weight": ("mlp", "down_lora"),
}
_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the file and the key."""


@dataclass(frozen=True)
class LoraModule:
    """One targeted module of an adapter, placed in the model."""

    module: str  # checkpoint module path, e.g. "model.layers.0.self_attn.q_proj"
    param: str  # the model parameter it adapts, e.g. "layers.0.attn.qkv_proj.weight"
    rows: slice  # the parameter's rows that module fills (on this rank)
    a: torch.Tensor  # [r, in] float32: under tensor parallelism, this rank's input columns of a row-parallel module
    b: torch.Tensor  # [rows, r] float32: this rank's rows of a column-parallel module


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    modules: tuple[LoraModule, ...]


def load_adapter(path: str | Path, model: DecoderLM, name: str, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA directory against `model`. Raises LoraError."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoraError(f"{directory}: adapter '{name}': directory not found")
    config_path = directory / ADAPTER_CONFIG_FILE
    try:
        config = read_json(config_path)
    except CheckpointError as e:
        raise LoraError(f"adapter '{name}': {e}") from e
    rank, scale, targets = _read_config(config, config_path, max_rank)
    weights_path = directory / ADAPTER_WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraError(f"{weights_path}: file not found (adapters are read from safetensors only)")
    try:
        with safe_open(weights_path, framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LoraError(f"{weights_path}: not a readable safetensors file: {e}") from e
    for key, tensor in tensors.items():
        bad = non_finite_count(tensor)
        if bad:
            raise LoraError(f"{weights_path}: adapter '{name}': tensor {key!r} holds NaN or infinite values: {bad} "
                            f"of its {tensor.numel()}")
    return LoraAdapter(name, directory, rank, scale, _place(tensors, model, rank, targets, weights_path))


def _read_config(config: dict, path: Path, max_rank: int) -> tuple[int, float, list[str] | str]:
    def fail(key, message):
        raise LoraError(f"{path}: key '{key}' {message}")

    if config.get("peft_type", "LORA") != "LORA":
        fail("peft_type", f"is {config['peft_type']!r}; only 'LORA' adapters are supported")
    if config.get("modules_to_save"):
        fail("modules_to_save", f"is {config['modules_to_save']!r}: an adapter that replaces whole modules is "
                                "not supported, only low-rank deltas")
    for key, allowed in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, allowed) != allowed:
            fail(key, f"is {config[key]!r}; only {allowed!r} is supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            fail(key, "sets per-module ranks or alphas, which are not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        fail("r", f"must be a positive integer, got {rank!r}")
    if rank > max_rank:
        fail("r", f"is {rank}, above config field 'max_lora_rank' ({max_rank})")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        fail("lora_alpha", f"must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        fail("use_rslora", f"must be true or false, got {rslora!r}")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        fail("target_modules", f"must be a list of module names or a regular expression, got {targets!r}")
    return rank, alpha / (math.sqrt(rank) if rslora else rank), targets


def _targeted(module: str, targets: list[str] | str) -> bool:
    """PEFT's matching: a string is a regular expression over the full name ("all-linear" is every linear
    layer), a list entry names the module or a suffix of its path."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _place(tensors: dict[str, torch.Tensor], model: DecoderLM, rank: int, targets: list[str] | str,
           path: Path) -> tuple[LoraModule, ...]:
    layout = model.checkpoint_layout()
    pairs: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"lora_A": .., "lora_B": ..}
    for key, tensor in tensors.items():
        match = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_A|lora_B)\.weight", key)
        if match is None:
            raise LoraError(f"{path}: unexpected tensor {key!r}; a LoRA adapter holds "
                            f"'{PEFT_PREFIX}<module>.lora_A.weight' and '.lora_B.weight' only")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    if not pairs:
        raise LoraError(f"{path}: holds no LoRA tensors")
    modules = []
    for module, pair in sorted(pairs.items()):
        key = f"{PEFT_PREFIX}{module}"
        for half in ("lora_A", "lora_B"):
            if half not in pair:
                raise LoraError(f"{path}: {key}.{half}.weight is missing")
        weight = layout.get(module + ".weight")
        target = None if weight is None else _LAYER_PARAM.fullmatch(weight.param)
        if target is None or target[2] not in TARGETS:
            raise LoraError(f"{path}: {key} adapts {module!r}, which is not an attention or MLP projection of this "
                            f"{model.arch.model_name} model")
        if not _targeted(module, targets):
            raise LoraError(f"{path}: {key} adapts {module!r}, which adapter_config.json's target_modules "
                            f"({targets!r}) does not name")
        a, b = pair["lora_A"], pair["lora_B"]
        out_features, in_features = weight.shape
        for half, tensor, want in (("lora_A", a, (rank, in_features)), ("lora_B", b, (out_features, rank))):
            if tuple(tensor.shape) != want:
                raise LoraError(f"{path}: {key}.{half}.weight has shape {tuple(tensor.shape)}, expected {want} "
                                f"(r {rank}, the model's {module} is {out_features}x{in_features})")
            if not tensor.is_floating_point():
                raise LoraError(f"{path}: {key}.{half}.weight has dtype {tensor.dtype}, expected a float type")
        # This rank's pieces of the module, as the loader copies its weight: B's rows of a column-parallel part, A's
        # columns of a row-parallel module (its partial delta is summed over ranks with the projection's output).
        for rows, source in weight.pieces:
            piece_b = b[source[0]] if len(source) == 1 else b
            piece_a = a[:, source[1]] if len(source) == 2 else a
            modules.append(LoraModule(module, weight.param, rows, piece_a.float(), piece_b.float()))
    return tuple(modules)


def merge_adapter(model: DecoderLM, adapter: LoraAdapter) -> None:
    """W += scale · B · A in place, into the rows of the fused parameters: computed in float32 (float64 for a
    float64 model), then cast to the weight's dtype. The merged model runs at the base model's cost."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for m in adapter.modules:
            target = params[m.param][m.rows]
            dtype = torch.promote_types(target.dtype, torch.float32)
            delta = m.b.to(target.device, dtype) @ m.a.to(target.device, dtype)
            merged = (target.to(dtype) + adapter.scale * delta).to(target.dtype)
            _check_in_range(merged, f"adapter '{adapter.name}' merged into {m.module}")
            target.copy_(merged)


def _check_in_range(values: torch.Tensor, what: str) -> None:
    """An adapter's values, finite in its file, must stay finite in the model's dtype: an infinity in a weight
    decodes noise."""
    bad = non_finite_count(values)
    if bad:
        raise LoraError(f"{what} is {past_range(values.dtype)}, at {bad} of its {values.numel()} values; "
                        f"{wider_dtype(values.dtype)}")


def attach_adapters(model: DecoderLM, adapters: list[LoraAdapter]) -> None:
    """Stack the adapters, slot i for adapters[i], on the projections any of them targets; the others keep no
    stack and pay nothing. The stacks' rank width is the largest rank among the adapters."""
    if not adapters:
        return
    params = dict(model.named_parameters())
    width = max(a.rank for a in adapters)
    # Each fused parameter's parts in row order: part i takes rank columns [i * width, i * width + r).
    parts: dict[str, list[int]] = {}
    for weight in model.checkpoint_layout().values():
        parts.setdefault(weight.param, []).extend(rows.start for rows, _ in weight.pieces)
    stacks: dict[str, LoraStack] = {}
    for slot, adapter in enumerate(adapters):
        for m in adapter.modules:
            param = params[m.param]
            starts = sorted(parts[m.param])
            stack = stacks.get(m.param)
            if stack is None:
                columns = len(starts) * width
                # In the model's dtype: an FP8 projection's weight is fp8, its adapters are not.
                dtype = model.embed_tokens.weight.dtype
                stack = stacks[m.param] = LoraStack(
                    a=param.new_zeros(len(adapters), columns, param.shape[1], dtype=dtype),
                    b=param.new_zeros(len(adapters), param.shape[0], columns, dtype=dtype))
            a, b = m.a.to(stack.a.dtype), (adapter.scale * m.b).to(stack.b.dtype)
            _check_in_range(a, f"adapter '{adapter.name}': {m.module}'s lora_A")
            _check_in_range(b, f"adapter '{adapter.name}': {m.module}'s lora_B times the adapter's scale")
            first = starts.index(m.rows.start) * width
            stack.a[slot, first:first + adapter.rank] = a
            stack.b[slot, m.rows, first:first + adapter.rank] = b
    for param, stack in stacks.items():
        layer, suffix = _LAYER_PARAM.fullmatch(param).groups()
        owner, attribute = TARGETS[suffix]
        setattr(model.get_submodule(f"layers.{layer}.{owner}"), attribute, stack)


def has_adapters(model: DecoderLM) -> bool:
    """Whether `attach_adapters` gave any projection a stack: forwards of this model may carry a LoraBatch."""
    return any(getattr(getattr(layer, owner), attribute, None) is not None
               for layer in model.layers for owner, attribute in TARGETS.values())


def lora_batch(plans: list[SeqPlan]) -> LoraBatch | None:
    """The forward's adapter segments, one per plan with an adapter, in row order; None when no plan has one.
    Two plans under one adapter stay two segments: a segment is then never longer than one sequence's feed, the
    bound a CUDA graph's LoRA kernels are sized by (cuda_graph.py)."""
    segments: list[tuple[int, int, int]] = []
    row = 0
    for plan in plans:
        slot, end = plan.sampling.lora_index, row + plan.num_tokens
        if slot >= 0 and end > row:
            segments.append((slot, row, end))
        row = end
    return LoraBatch(tuple(segments)) if segments else None
