"""Load a local Hugging Face checkpoint directory: config.json, then safetensors weights (one file, or shards
listed by model.safetensors.index.json), into the family's model, on the device, in the dtype.

Every failure is a `CheckpointError` that names the file and the key at fault.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

import diffulex_backend.models  # noqa: F401  (registers the families)
from diffulex_backend.attention import paged_attention_reference
from diffulex_backend.config import QUANTIZATIONS
from diffulex_backend.layers.fp8_linear import FP8
from diffulex_backend.models.decoder_lm import CheckpointWeight, DecoderLM
from diffulex_backend.quantization import (
    QUANTIZATION_CONFIG, SAFETENSORS_FP8, Fp8Scheme, check_unquantized, empty_fp8_layout,
    expand_scale, is_quantized_param, quantize_model, read_scheme, scale_columns, scale_param,
)
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.tensor_parallel import TensorParallel, check_shardable

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# The safetensors dtypes a float parameter loads from; fp8 comes with a quantization_config's scales.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the key."""


class CorruptWeight(CheckpointError):
    """A weight whose values no family could load: the same whichever family the checkpoint is read as."""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e


def read_config(path: str | Path) -> dict:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    return read_json(directory / CONFIG_FILE)


def detect_model_name(config: dict, path: str | Path) -> str:
    """The registered family named by config.json's "model_type", else the one that recognises the file by its
    "architectures" (or, for a family whose model_type is a generic one such as "llama", by its "auto_map")."""
    families = {name: AutoModelForDiffusionLM.get(name) for name in AutoModelForDiffusionLM.keys()}
    model_type = config.get("model_type")
    for name, family in families.items():
        if model_type in family.MODEL_TYPES:
            return name
    architectures = config.get("architectures") or []
    for name, family in families.items():
        if family.recognises(config):
            return name
    raise CheckpointError(
        f"{path}: config key 'model_type' is {model_type!r} (architectures {architectures!r}), which names no"
        f" registered model; registered: {sorted(families)}; pass model_name to choose one"
    )


def weight_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    single, index_path = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    if single.is_file():
        return {name: single for name in _tensor_names(single)}
    if not index_path.is_file():
        raise CheckpointError(f"{directory}: no weights: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} exists")
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: key 'weight_map' is missing or empty")
    files = {}
    for name, shard in weight_map.items():
        shard_path = directory / str(shard)
        if not shard_path.is_file():
            raise CheckpointError(f"{index_path}: weight {name!r} points at shard {shard!r}, which does not exist")
        files[name] = shard_path
    for shard_path in sorted(set(files.values())):
        held = set(_tensor_names(shard_path))
        listed = {name for name, p in files.items() if p == shard_path}
        if listed - held:
            missing = sorted(listed - held)[0]
            raise CheckpointError(f"{shard_path}: missing weight {missing!r} that {index_path.name} lists in it")
    return files


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e


def load_weights(model: DecoderLM, directory: Path, scheme: Fp8Scheme | None = None) -> None:
    """Fills the model's parameters from the checkpoint; with an FP8 scheme its fp8 weights and their scales (the
    model's quantized parameters already fp8, from `empty_fp8_layout`)."""
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    # checkpoint scale name -> the checkpoint weight it scales
    scales: dict[str, CheckpointWeight] = {}
    if scheme is not None:
        for name, weight in layout.items():
            if params[weight.param].dtype == FP8:
                scales[name.removesuffix("weight") + scheme.scale_suffix] = weight
    # Parts of a checkpoint a family does not serve (DiffusionGemma's vision tower) are left unread.
    ignored = getattr(model, "IGNORED_WEIGHT_PREFIXES", ())
    files = {name: file for name, file in weight_files(directory).items() if not name.startswith(ignored)}
    source = directory / (WEIGHTS_FILE if (directory / WEIGHTS_FILE).is_file() else WEIGHTS_INDEX_FILE)
    unexpected = sorted(set(files) - set(layout) - set(scales))
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected weight {unexpected[0]!r} for model {model.arch.model_name!r}")
    missing = sorted(set(layout) - set(files)) + sorted(set(scales) - set(files))
    if missing:
        raise CheckpointError(f"{source}: missing weight {missing[0]!r}")
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for number, (file, names) in enumerate(sorted(by_file.items()), start=1):
            started = time.monotonic()
            try:
                with safe_open(file, framework="pt") as f:
                    for name in names:
                        if name in scales:
                            where = f"{file}: scale {name!r}"
                            _check_scale_dtype(where, f.get_slice(name).get_dtype())
                            _load_scale(f.get_tensor(name), scales[name], params, scheme, where)
                            continue
                        expected = layout[name]
                        tensor = f.get_slice(name)
                        shape = tuple(tensor.get_shape())
                        if shape != expected.shape:
                            raise CheckpointError(
                                f"{file}: weight {name!r} has shape {shape}, expected {expected.shape}"
                            )
                        param = params[expected.param]
                        _check_dtype(file, name, tensor.get_dtype(), param.dtype)
                        if expected.expert is not None:
                            param = param[expected.expert]
                        # Each rank reads only its pieces of the tensor, not the whole of it.
                        for rows, source in expected.pieces:
                            param[rows].copy_(_read(f, tensor, name, source))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
            except ValueError as e:
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(str(e)) from e
            # A large model reads for a minute or more: say how far it got.
            logger.info("read weights file %d of %d, %s (%.2f GiB), in %.1f s", number, len(by_file), file.name,
                        file.stat().st_size / 2**30, time.monotonic() - started)
        _check_finite(layout, params, sorted(by_file.items()))


def _read(f, tensor, name: str, source: tuple) -> torch.Tensor:
    """A piece of tensor `name` (`tensor`, its slice in the open file `f`): the whole of it, or the rows and columns
    `source` takes."""
    return f.get_tensor(name) if source == () else tensor[source]


def _fp8_nan(values: torch.Tensor) -> torch.Tensor:
    """Where float8_e4m3fn values are NaN: every byte whose low seven bits are set (it has no infinities)."""
    return (values.view(torch.uint8) & 0x7F) == 0x7F


def is_finite(values: torch.Tensor) -> torch.Tensor:
    """Whether a float tensor holds no NaN and no infinity, as a bool on its device, so a caller decides when to
    wait for it. In fp8, one reduction over the bytes' low seven bits: 0x7F only where a NaN is (`_fp8_nan`)."""
    if not values.numel():
        return torch.ones((), dtype=torch.bool, device=values.device)
    if values.dtype == FP8:
        return (values.view(torch.uint8) & 0x7F).amax() != 0x7F
    return torch.stack([values.amax(), values.amin()]).isfinite().all()


def non_finite_count(values: torch.Tensor) -> int:
    """How many of a float tensor's values are NaN or infinite: a corrupt file or a diverged training run loads
    without error and decodes noise (every token the same one, often), so a loader refuses it by name. Counted
    only when there is something to count."""
    if not values.is_floating_point() or is_finite(values):
        return 0
    if values.dtype == FP8:
        return int(_fp8_nan(values).sum())
    return int((~values.isfinite()).sum())


def _check_finite(layout: dict[str, CheckpointWeight], params: dict[str, torch.Tensor],
                  files: list[tuple[Path, list[str]]]) -> None:
    """Refuses the first checkpoint weight, in the order `files` were read, whose loaded piece is not finite, by
    name, reading it again to say whether the file or the model's dtype is at fault. Each parameter is checked whole,
    with one wait on the device for them all: a check a piece costs LLaDA2-mini's 15k expert pieces about 2 s of
    launches and waits (benchmarks/load_check.py)."""
    loaded = sorted({weight.param for weight in layout.values()})
    finite = torch.stack([is_finite(params[name]) for name in loaded])
    if finite.all():
        return
    bad = [loaded[i] for i in (~finite).nonzero().flatten().tolist()]
    for file, names in files:
        for name in names:
            weight = layout.get(name)
            if weight is None or weight.param not in bad:
                continue  # a scale, or a weight whose parameter is finite
            param = params[weight.param] if weight.expert is None else params[weight.param][weight.expert]
            for rows, source in weight.pieces:
                if non_finite_count(param[rows]):
                    with safe_open(file, framework="pt") as f:
                        values = _read(f, f.get_slice(name), name, source)
                    raise CorruptWeight(_not_finite(file, name, values, param[rows]))
    # Rows no checkpoint weight fills are the family's to set (a padded vocabulary's rows are zeros).
    raise CheckpointError(f"parameter {bad[0]!r} is not finite in rows that no checkpoint weight fills")


def _not_finite(file: Path, name: str, values: torch.Tensor, piece: torch.Tensor) -> str:
    """Why a weight's piece (`values` as read, `piece` as loaded) is not finite: NaN or infinities in the file, or
    finite values past the range of the dtype the model loads in."""
    read = f"of the {values.numel()} values read"  # this rank's share, under tensor parallelism
    in_file = non_finite_count(values)
    if in_file:
        return f"{file}: weight {name!r} holds NaN or infinite values: {in_file} {read}"
    return (f"{file}: weight {name!r} is finite in the file but {past_range(piece.dtype)}, at "
            f"{non_finite_count(piece)} {read}; {wider_dtype(piece.dtype)}")


def past_range(dtype: torch.dtype) -> str:
    """Words for values that overflow the model's dtype, with its largest finite value."""
    return (f"past the range of {str(dtype).removeprefix('torch.')} (largest {torch.finfo(dtype).max:g}), the dtype "
            "the model loads in")


def wider_dtype(dtype: torch.dtype) -> str:
    """What to do about values past `dtype`'s range: a wider dtype where one serves, else nothing does."""
    if torch.finfo(dtype).max < torch.finfo(torch.float32).max:
        return "load it in a wider one, such as bfloat16 or float32"
    return "no dtype the model serves in but float64 holds them"


def _check_dtype(file: Path, name: str, stored: str, param_dtype: torch.dtype) -> None:
    """A float parameter takes a float tensor only, and an fp8 parameter an fp8 tensor only: integers, or a float8
    byte read as a number, or a float rounded to float8 without its scale, would load without error and decode
    noise."""
    if stored not in (*FLOAT_DTYPES, SAFETENSORS_FP8):
        raise CorruptWeight(f"{file}: weight {name!r} is stored as {stored}; a weight loads from "
                            f"{', '.join(FLOAT_DTYPES)}, or from {SAFETENSORS_FP8} (float8_e4m3fn) with a "
                            f"'{QUANTIZATION_CONFIG}'")
    if param_dtype == FP8 and stored != SAFETENSORS_FP8:
        raise CheckpointError(f"{file}: weight {name!r} is stored as {stored}, but config.json's "
                              f"'{QUANTIZATION_CONFIG}' makes it a {SAFETENSORS_FP8} (float8_e4m3fn) weight")
    if param_dtype != FP8 and stored == SAFETENSORS_FP8:
        raise CheckpointError(f"{file}: weight {name!r} is stored as {SAFETENSORS_FP8} (float8_e4m3fn), but "
                              f"config.json has no '{QUANTIZATION_CONFIG}' with quant_method 'fp8' that says how it "
                              "is scaled")


def _check_scale_dtype(where: str, stored: str) -> None:
    """A scale is a float: integers or booleans would load as numbers and scale the weight by them."""
    if stored not in FLOAT_DTYPES:
        raise CorruptWeight(f"{where} is stored as {stored}; a scale loads from {', '.join(FLOAT_DTYPES)}")


def _load_scale(tensor: torch.Tensor, weight: CheckpointWeight, params: dict, scheme: Fp8Scheme, where: str) -> None:
    """A checkpoint scale into the rows (and column blocks) of the weight's scale parameter that this rank holds."""
    rows, columns = weight.shape[-2:]
    scale = tensor.to(torch.float32)
    if not (scale.isfinite() & (scale > 0)).all():
        raise CorruptWeight(f"{where} holds a scale that is not a finite positive number in float32")
    expanded = expand_scale(scale, rows, columns, scheme.block, where)  # [rows, G of the whole tensor]
    param = params[scale_param(weight.param)]
    if weight.expert is not None:
        param = param[weight.expert]
    for target_rows, source in weight.pieces:
        param[target_rows].copy_(expanded[scale_columns(source, expanded.shape[1], columns, scheme.block)])


def load_model(
    path: str | Path,
    *,
    model_name: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention_fn=paged_attention_reference,
    tp: TensorParallel = TensorParallel(),
    quantization: str | None = None,
    fp8_lm_head: bool = False,
) -> DecoderLM:
    """The model, or this rank's share of it under tensor parallelism. An FP8 checkpoint (config.json's
    quantization_config) loads with its fp8 weights and scales; `quantization` "fp8" quantizes a float checkpoint's
    projections at load (quantization.py), and `fp8_lm_head` its output head too."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"config field 'quantization' must be one of {[None, *QUANTIZATIONS]}, got {quantization!r}")
    if model_name is not None and model_name not in AutoModelForDiffusionLM:
        raise ValueError(f"config field 'model_name' must be one of {AutoModelForDiffusionLM.keys()} or null, got "
                         f"{model_name!r}")
    directory = Path(path)
    config = read_config(directory)
    config_path = directory / CONFIG_FILE
    name = detect_model_name(config, config_path) if model_name is None else model_name
    try:
        scheme = read_scheme(config, config_path)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    # The family parses the architecture; the scheme is the loader's.
    config = {k: v for k, v in config.items() if k != QUANTIZATION_CONFIG}
    family = AutoModelForDiffusionLM.get(name)
    try:
        arch = family.parse_config(config, config_path)
    except ValueError as e:  # CheckpointError among them
        raise _read_as(e, name, model_name) from e
    if arch.unrecognized_config_keys:
        logger.warning("%s: config keys %s are unknown to model %r and were not read; the model loads without them",
                       config_path, list(arch.unrecognized_config_keys), arch.model_name)
    check_shardable(arch, tp)
    if (scheme is not None or quantization) and torch.device(device).type == "cuda":
        check_fp8_device(torch.device(device), "an FP8 checkpoint" if scheme else "quantization 'fp8'")
    model = family.empty(arch, attention_fn, dtype=dtype, device=device, tp=tp)
    try:
        if scheme is not None:
            _prepare_fp8(model, scheme, config_path)
        load_weights(model, directory, scheme)
    except CorruptWeight:
        raise
    except CheckpointError as e:
        raise _read_as(e, name, model_name) from e
    if quantization or scheme is not None:
        quantize_model(model, lm_head=fp8_lm_head)
    return model.eval()


def _read_as(error: Exception, name: str, model_name: str | None) -> CheckpointError:
    """A checkpoint's error, saying which family it was read as and where that name came from. Some families share
    a config.json model_type (Dream, DiffuCoder, Dream-reasoner), so a checkpoint that does not fit the family it
    was read as is most often another's."""
    source = "the settings' model_name" if model_name is not None else "detected from config.json"
    return CheckpointError(f"{error} (read as model_name {name!r}, {source}; set model_name to load the checkpoint as "
                           f"another family: {AutoModelForDiffusionLM.keys()})")


def _prepare_fp8(model: DecoderLM, scheme: Fp8Scheme, config_path: Path) -> None:
    """The empty model's quantized parameters as fp8 weights and scales laid out for the checkpoint's scheme."""
    layout = model.checkpoint_layout()
    try:
        check_unquantized(scheme, {n: w.param for n, w in layout.items() if is_quantized_param(w.param)})
        empty_fp8_layout(model, scheme, layout)
    except ValueError as e:
        raise CheckpointError(f"{config_path}: {e}") from e


def check_fp8_device(device: torch.device, what: str, why: str = "for its FP8 products") -> None:
    """FP8 tensor-core products and conversions need compute capability 8.9 (Ada) or newer: refused by name on an
    older GPU."""
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"{what} needs a GPU of compute capability 8.9 or newer (Ada, Hopper) {why};"
                         f" {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
