"""FP8 weights for a model: which parameters are quantized, quantizing a float model at load, and reading the
FP8 checkpoints that Hugging Face releases ship.

Quantized: every linear projection of the decoder (qkv, o, gate_up, down) and the MoE experts' stacks; the LM head
only with `fp8_lm_head`. Embeddings, norms and routers stay in the model's dtype. A quantized weight is float8_e4m3fn
with float32 scales (`layers/fp8_linear.py` says how they are laid out); the scale parameter is the weight's name
with `_scale` appended.

A released FP8 checkpoint names its scheme in config.json:

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}

- with `weight_block_size` [bn, bk] (Qwen3-FP8, DeepSeek-V3) each projection `X.weight` is float8_e4m3fn [N, K]
  with `X.weight_scale_inv` [ceil(N / bn), ceil(K / bk)], and stands for weight * scale_inv blockwise;
- without it, `X.weight_scale` is one scale per output channel ([N] or [N, 1]) or per tensor ([] or [1]).
Activations are always cast per token at run time, so only the "dynamic" activation scheme is read; a static one
ships `input_scale` tensors for a per-tensor activation scale, which this engine does not apply, and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from diffulex_backend.layers.fp8_linear import FP8, Fp8Linear, quantize_weight
from diffulex_backend.models.decoder_lm import SPLITS, Split

QUANTIZATION_CONFIG = "quantization_config"
# Parameter name suffixes of the projections that are quantized.
QUANTIZED_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "w_gate_up",
                      "w_down")
LM_HEAD = "lm_head.weight"
# The checkpoint dtype name safetensors gives float8_e4m3fn.
SAFETENSORS_FP8 = "F8_E4M3"
_KNOWN_KEYS = {"quant_method", "activation_scheme", "fmt", "weight_block_size", "ignored_layers",
               "modules_to_not_convert"}


@dataclass(frozen=True)
class Fp8Scheme:
    """How a released FP8 checkpoint stores its scales."""

    block: tuple[int, int] | None  # (rows, columns) of a block scale; None: per channel or per tensor
    unquantized: tuple[str, ...] = ()  # modules the checkpoint keeps in its float dtype

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.block else "weight_scale"


def scale_param(param: str) -> str:
    """The name of the scale parameter of a quantized weight parameter."""
    return param + "_scale"


def is_quantized_param(name: str, lm_head: bool = False) -> bool:
    return name.endswith(QUANTIZED_SUFFIXES) or (lm_head and name == LM_HEAD)


def read_scheme(config: dict, path: str | Path) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme from config.json's quantization_config; None when it has none. Raises ValueError
    naming the file, the key and the value of any scheme this engine does not load."""
    qc = config.get(QUANTIZATION_CONFIG)
    if qc is None:
        return None
    where = f"{path}: config key '{QUANTIZATION_CONFIG}'"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be a JSON object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{where} has quant_method {method!r}, which this engine does not load; it loads 'fp8' "
                         "checkpoints (per-channel weight_scale, or 128x128 block weight_scale_inv), or a bf16 "
                         "checkpoint quantized at load with the setting quantization: fp8")
    unknown = sorted(set(qc) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{where} has keys {unknown} that this engine does not read; known: {sorted(_KNOWN_KEYS)}")
    activation = qc.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise ValueError(f"{where} has activation_scheme {activation!r}: only 'dynamic' (a scale per token computed "
                         "at run time) is supported")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where} has fmt {fmt!r}: only 'e4m3' (float8_e4m3fn) is supported")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
            raise ValueError(f"{where} has weight_block_size {block!r}: expected two positive integers")
        block = (block[0], block[1])
    unquantized = []
    for key in ("ignored_layers", "modules_to_not_convert"):
        names = qc.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where} has {key} {names!r}: expected a list of module names")
        unquantized += names
    return Fp8Scheme(block, tuple(unquantized))


def check_unquantized(scheme: Fp8Scheme, checkpoint_names: dict[str, str]) -> None:
    """Refuses a checkpoint that keeps in its float dtype a projection this engine runs in FP8 (checkpoint_names:
    checkpoint weight name -> parameter name, of the quantized parameters). Modules it keeps that stay in float here
    anyway (lm_head, routers, embeddings) are what releases list, and pass."""
    for module in scheme.unquantized:
        for name in checkpoint_names:
            if name.startswith(module + ".") or f".{module}." in f".{name}":
                raise ValueError(f"config key '{QUANTIZATION_CONFIG}' keeps module {module!r} unquantized, "
                                 f"which holds weight {name!r} that this engine loads in FP8; a checkpoint with "
                                 "unquantized projections is not supported")


def scale_groups(local_k: int, full_k: int, block: tuple[int, int] | None, name: str) -> int:
    """G of a weight's [N, G] scale: 1 per channel, or this rank's column blocks of a block-scaled checkpoint
    (1 when one block spans all columns)."""
    if block is None or full_k <= block[1]:
        return 1
    if full_k % block[1] or local_k % block[1]:
        raise ValueError(f"weight {name!r} has {full_k} columns ({local_k} on this rank), not a multiple of the "
                         f"checkpoint's block of {block[1]} columns")
    return local_k // block[1]


def fp8_params(model: nn.Module, lm_head: bool) -> list[str]:
    """The model's parameters that FP8 quantizes, in parameter order."""
    names = [n for n, _ in model.named_parameters() if is_quantized_param(n, lm_head)]
    if lm_head and LM_HEAD not in names:
        raise ValueError("config field 'fp8_lm_head' is true, but the model ties its output head to the embedding "
                         "table, which stays in the model's dtype")
    return names


def replace_param(model: nn.Module, name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Puts the fp8 weight and its scale in place of parameter `name`: an nn.Linear becomes an Fp8Linear; a MoE
    stack (w_gate_up, w_down) takes the fp8 tensor and a `<name>_scale` parameter beside it."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, nn.Linear) or isinstance(owner, Fp8Linear):
        parent_name, _, child = owner_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        bias = owner.bias.data if owner.bias is not None else None
        setattr(parent, child, Fp8Linear(weight, scale, bias))
        return
    setattr(owner, attr, nn.Parameter(weight, requires_grad=False))
    setattr(owner, scale_param(attr), nn.Parameter(scale, requires_grad=False))


def empty_fp8_layout(model: nn.Module, scheme: Fp8Scheme, layout: dict) -> None:
    """Turns the quantized parameters of an empty model into uninitialized fp8 weights and scales, shaped for the
    checkpoint's scheme, for the loader to fill. layout: model.checkpoint_layout() before the change."""
    full_k = {w.param: w.shape[-1] for w in layout.values()}
    for name in fp8_params(model, lm_head=False):
        param = dict(model.named_parameters())[name]
        groups = scale_groups(param.shape[-1], full_k[name], scheme.block, name)
        weight = torch.empty(param.shape, dtype=FP8, device=param.device)
        scale = torch.empty(*param.shape[:-1], groups, dtype=torch.float32, device=param.device)
        replace_param(model, name, weight, scale)


@torch.no_grad()
def quantize_model(model: nn.Module, lm_head: bool = False) -> None:
    """Quantizes, in place and one parameter at a time, every parameter FP8 covers that is not fp8 yet, with a
    scale per output channel. A MoE stack goes one expert at a time, so the float32 work tensors stay small.

    Under tensor parallelism a row-parallel weight (o_proj, down_proj, the experts' down stack) holds a share of
    each row's columns: the row's absolute maximum is taken over all ranks, so every rank holds the scales and fp8
    values of one rank's model, and the ranks together compute what it computes."""
    tp = getattr(model, "tp", None)
    for name in fp8_params(model, lm_head):
        param = dict(model.named_parameters())[name]
        if param.dtype == FP8:
            continue
        stack = param if param.dim() == 3 else param[None]  # [E, N, K], E = 1 for a projection
        amax = torch.stack([w.abs().amax(-1, keepdim=True).float() for w in stack])  # [E, N, 1]
        split = next((v for k, v in SPLITS.items() if name.endswith(k)), Split.REPLICATED)
        if tp is not None and tp.size > 1 and split is Split.ROW and not (param.dim() == 3 and tp.expert_parallel):
            tp.all_reduce_max(amax)
        weight = torch.empty(stack.shape, dtype=FP8, device=param.device)
        scale = torch.empty(*stack.shape[:-1], 1, dtype=torch.float32, device=param.device)
        for expert in range(stack.shape[0]):
            weight[expert], scale[expert] = quantize_weight(stack[expert], amax=amax[expert])
        replace_param(model, name, *((weight, scale) if param.dim() == 3 else (weight[0], scale[0])))


def has_fp8(model: nn.Module) -> bool:
    return any(p.dtype == FP8 for p in model.parameters())


def expand_scale(scale: torch.Tensor, rows: int, columns: int, block: tuple[int, int] | None, where: str
                 ) -> torch.Tensor:
    """A checkpoint scale for a weight of [rows, columns] as [rows, G] float32: per tensor and per channel give
    G = 1; a block scale [ceil(rows / bn), ceil(columns / bk)] has each row of blocks repeated over its rows.
    Raises ValueError naming `where` for a misshapen scale."""
    if block is None:
        if scale.numel() == 1:
            expanded = scale.reshape(1, 1).expand(rows, 1)
        elif tuple(scale.shape) in ((rows,), (rows, 1)):
            expanded = scale.reshape(rows, 1)
        else:
            raise ValueError(f"{where} has shape {tuple(scale.shape)}, expected ({rows},), ({rows}, 1) or one value "
                             f"for a weight of {rows} rows")
    else:
        expected = (-(-rows // block[0]), -(-columns // block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{where} has shape {tuple(scale.shape)}, expected {expected} for a weight of "
                             f"{(rows, columns)} in blocks of {block}")
        expanded = scale.repeat_interleave(block[0], dim=0)[:rows]
    return expanded.to(torch.float32)


def scale_columns(source: tuple[slice, ...], groups: int, columns: int, block: tuple[int, int] | None
                  ) -> tuple[slice, ...]:
    """The index into an expanded [rows, G] scale of what `source` indexes in its [rows, columns] weight: the same
    rows, and the column blocks of a column share (a row-parallel share under tensor parallelism)."""
    if len(source) < 2 or groups == 1:
        return source[:1]
    cols = source[1]
    start, stop = cols.start or 0, columns if cols.stop is None else cols.stop
    return source[0], slice(start // block[1], stop // block[1])
