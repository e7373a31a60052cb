"""Read the engine settings from a Triton model config's `parameters`.

Triton hands every parameter over as a string (`{"block_size": {"string_value": "32"}}`). Each name must
be a field of `Config`, and each value is converted to that field's type here so that a typo fails the
model load with a message naming the parameter, instead of reaching the engine as a string. An empty
value leaves an optional field unset (the engine detects or derives it). A relative path (`model`, `lora_path`,
each path of `lora_modules`, and `profile_dir`) is resolved against the model's directory in the repository.

A model instance that Triton places on a GPU (`instance_group` of `KIND_GPU`) runs its engine on that GPU:
`on_instance_device` turns the settings into that instance's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..config import Config
from .text_values import field_types, from_text, optional_fields


# The Python backend's own parameters, which share the `parameters` section with the engine's: the packed Python
# environment the model runs in, and where the backend hands the model its input tensors.
BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS")


def engine_settings(parameters: Mapping[str, Mapping[str, str]], model_dir: str | Path) -> dict:
    """Config keyword arguments from a model config's `parameters` section."""
    types_by_field, optional = field_types(Config), optional_fields(Config)
    settings = {}
    for name, holder in parameters.items():
        if name in BACKEND_PARAMETERS:
            _check_backend_parameter(name, holder.get("string_value", ""))
            continue
        if name not in types_by_field:
            raise ValueError(f"unknown parameter '{name}' in config.pbtxt; known parameters: {Config.field_names()}")
        value = _convert(name, holder.get("string_value", ""), types_by_field[name], name in optional)
        if value is not None:
            settings[name] = value
    if "model" not in settings:
        raise ValueError("parameter 'model' in config.pbtxt must name a checkpoint directory")
    settings["model"] = _resolved(settings["model"], model_dir)
    for name in ("lora_path", "profile_dir"):
        if name in settings:
            settings[name] = _resolved(settings[name], model_dir)
    if "lora_modules" in settings:  # name=path pairs, each path resolved like model's
        pairs = [item.partition("=") for item in settings["lora_modules"].split(",")]
        settings["lora_modules"] = ",".join(
            f"{name.strip()}={_resolved(path, model_dir)}" if sep and path.strip() else name + sep + path
            for name, sep, path in pairs)
    return settings


def on_instance_device(settings: dict, instance_kind: str, device_id: int) -> dict:
    """The settings of one model instance. Triton gives a KIND_GPU group one instance per GPU it lists, each told
    its GPU: that instance's engine runs there (with tensor parallelism, there and on the GPUs after it), so that
    the instances do not all land on the first GPU. A `device` that names another place contradicts the
    instance_group, and fails the load. Other kinds (KIND_MODEL, KIND_CPU) leave the device to `device`."""
    if instance_kind != "GPU":
        return settings
    placed = f"cuda:{device_id}"
    device = settings.get("device", "auto")
    if device not in ("auto", "cuda", placed):
        raise ValueError(
            f"parameter 'device' in config.pbtxt is {device!r}, but instance_group (KIND_GPU) places this instance "
            f"on GPU {device_id} ({placed!r}): set 'device' to 'auto' to run each instance on the GPU Triton gives "
            f"it, or use KIND_MODEL to choose the device with 'device'")
    return {**settings, "device": placed}


def _check_backend_parameter(name: str, text: str) -> None:
    """The backend reads these itself; the model only refuses what it could not run with."""
    if name == "FORCE_CPU_ONLY_INPUT_TENSORS" and text != "yes":
        raise ValueError(f"parameter 'FORCE_CPU_ONLY_INPUT_TENSORS' in config.pbtxt must be 'yes', got {text!r}: the "
                         "model reads its inputs (text, token ids, settings) on the host")


def _resolved(path: str, model_dir: str | Path) -> str:
    """A path as config.pbtxt gives it: a relative one starts at the model's directory in the repository."""
    resolved = Path(path.strip()).expanduser()
    return str(resolved if resolved.is_absolute() else Path(model_dir) / resolved)


def _convert(name: str, text: str, base, optional: bool) -> object:
    if text.strip() == "":
        if optional:
            return None
        raise ValueError(f"parameter '{name}' in config.pbtxt needs a value")
    try:
        return from_text(text, base)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[base]
        raise ValueError(f"parameter '{name}' in config.pbtxt must be {kind}, got {text.strip()!r}") from None
