"""DiffusionGemma's norms on the Triton kernel (every weighted norm, the per-head q/k norms, and the unweighted V,
router and self-conditioning norms): its forward over a prompt and two canvas steps stays as near the float64
forward as the torch norms' does, in float32: the two differ by rounding only."""
from __future__ import annotations

import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.models import diffusion_gemma
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint
from kernel_cases import DEVICE, relative_error

CANVAS = 8
SETTINGS = dict(model_name="diffusion_gemma", block_size=CANVAS, page_size=4, max_model_len=96,
                max_num_batched_tokens=64, num_kv_pages=32, dtype="float32", device=str(DEVICE), enforce_eager=True)


def hidden_states(checkpoint: str, kernel_norms: bool, monkeypatch, dtype: str = "float32") -> list[torch.Tensor]:
    """The final norm's output at each of a request's first three forwards: its prompt, then two canvas steps."""
    # On a CPU the interpreter runs the kernel; on a GPU the torch norms are the ones switched in.
    monkeypatch.setattr(diffusion_gemma, "on_norm_kernel", lambda x: kernel_norms and x.dtype != torch.float64)
    llm = Diffulex(checkpoint, **{**SETTINGS, "dtype": dtype}, attention_backend="torch")
    captured = []
    hook = llm.model.norm.register_forward_hook(lambda module, args, out: captured.append(out.detach().clone()))
    try:
        llm.add_request(list(range(40, 61)), SamplingParams(max_tokens=CANVAS, seed=4, ignore_eos=True))
        while len(captured) < 3 and llm.has_unfinished_requests():
            llm.step()
    finally:
        hook.remove()
    return captured[:3]


def test_the_kernel_norms_give_the_torch_norms_forward(tmp_path, monkeypatch):
    checkpoint = str(write_random_diffusion_gemma_checkpoint(tmp_path / "ckpt", seed=6))
    kernel = hidden_states(checkpoint, True, monkeypatch)
    torch_norms = hidden_states(checkpoint, False, monkeypatch)
    exact = hidden_states(checkpoint, False, monkeypatch, dtype="float64")
    assert len(kernel) == len(torch_norms) == len(exact) == 3
    for out, ref, float64 in zip(kernel, torch_norms, exact):
        assert out.shape == ref.shape == float64.shape
        # Float32 rounding over four random layers: about 1e-4 of the float64 states, for either path (the torch
        # norms, rounding twice a norm, are the farther at the last step); a dropped weight or a norm over the
        # wrong axis would be of the states' own size.
        assert relative_error(ref, float64) < 3e-4
        assert relative_error(out, float64) < 3e-4
