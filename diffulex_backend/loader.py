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
from diffulex_backend.models.decoder_lm import DecoderLM
from diffulex_backend.registry import AutoModelForDiffusionLM
from diffulex_backend.tensor_parallel import TensorParallel, check_shardable

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the key."""


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


def load_weights(model: DecoderLM, directory: Path) -> None:
    layout = model.checkpoint_layout()
    # Parts of a checkpoint a family does not serve (DiffusionGemma's vision tower) are left unread.
    ignored = getattr(model, "IGNORED_WEIGHT_PREFIXES", ())
    files = {name: file for name, file in weight_files(directory).items() if not name.startswith(ignored)}
    source = directory / (WEIGHTS_FILE if (directory / WEIGHTS_FILE).is_file() else WEIGHTS_INDEX_FILE)
    unexpected = sorted(set(files) - set(layout))
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected weight {unexpected[0]!r} for model {model.arch.model_name!r}")
    missing = sorted(set(layout) - set(files))
    if missing:
        raise CheckpointError(f"{source}: missing weight {missing[0]!r}")
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for number, (file, names) in enumerate(sorted(by_file.items()), start=1):
            started = time.monotonic()
            try:
                with safe_open(file, framework="pt") as f:
                    for name in names:
                        expected = layout[name]
                        tensor = f.get_slice(name)
                        shape = tuple(tensor.get_shape())
                        if shape != expected.shape:
                            raise CheckpointError(
                                f"{file}: weight {name!r} has shape {shape}, expected {expected.shape}"
                            )
                        param = params[expected.param]
                        if expected.expert is not None:
                            param = param[expected.expert]
                        # Each rank reads only its pieces of the tensor, not the whole of it.
                        for rows, source in expected.pieces:
                            param[rows].copy_(f.get_tensor(name) if source == () else tensor[source])
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
            # A large model reads for a minute or more: say how far it got.
            logger.info("read weights file %d of %d, %s (%.2f GiB), in %.1f s", number, len(by_file), file.name,
                        file.stat().st_size / 2**30, time.monotonic() - started)


def load_model(
    path: str | Path,
    *,
    model_name: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention_fn=paged_attention_reference,
    tp: TensorParallel = TensorParallel(),
) -> DecoderLM:
    """The model, or this rank's share of it under tensor parallelism."""
    directory = Path(path)
    config = read_config(directory)
    config_path = directory / CONFIG_FILE
    name = model_name or detect_model_name(config, config_path)
    try:
        family = AutoModelForDiffusionLM.get(name)
        arch = family.parse_config(config, config_path)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if arch.unrecognized_config_keys:
        logger.warning("%s: config keys %s are unknown to model %r and were not read; the model loads without them",
                       config_path, list(arch.unrecognized_config_keys), arch.model_name)
    check_shardable(arch, tp)
    model = family.empty(arch, attention_fn, dtype=dtype, device=device, tp=tp)
    try:
        load_weights(model, directory)
    except CheckpointError as e:
        if model_name is not None:
            raise
        # Some families share a config.json model_type (Dream, DiffuCoder, Dream-reasoner): weights that do not
        # fit the detected one are most often another's.
        raise CheckpointError(f"{e} (model_name {name!r} was detected from config.json; set model_name to load the"
                              f" checkpoint as another family: {AutoModelForDiffusionLM.keys()})") from e
    return model.eval()
