"""What the launch planners need to know of the device."""
from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count
