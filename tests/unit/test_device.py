"""A resolved device always carries its index: threads start on GPU 0, and torch.cuda.set_device refuses a bare
`cuda`. CI has no GPU, so CUDA's presence is faked; the fake set_device refuses what torch refuses."""

import pytest
import torch

from diffulex_backend.model_setup import resolve_device
from diffulex_backend.workers import rank_device


@pytest.fixture
def two_gpus(monkeypatch):
    current = []

    def set_device(device):
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        current.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return current


@pytest.mark.parametrize("name, expected", [("auto", "cuda:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_a_gpu_setting_resolves_to_an_indexed_device_that_set_device_takes(two_gpus, name, expected):
    device = resolve_device(name)
    assert device == torch.device(expected) and device.index is not None
    torch.cuda.set_device(device)
    assert two_gpus == [torch.device(expected)]


def test_a_gpu_past_the_machine_is_refused_by_name(two_gpus):
    with pytest.raises(ValueError, match=r"config field 'device' is 'cuda:2', but this machine has 2 CUDA device"):
        resolve_device("cuda:2")


def test_tensor_parallel_ranks_take_the_gpus_after_the_engines(two_gpus):
    assert [rank_device(resolve_device("auto"), rank) for rank in (0, 1)] == [torch.device("cuda", 0),
                                                                           torch.device("cuda", 1)]


def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device is available"):
        resolve_device("cuda")
