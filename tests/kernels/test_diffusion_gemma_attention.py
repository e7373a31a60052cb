"""DiffusionGemma's layers on the Triton attention kernel: its sliding window and both head sizes (64 for the
sliding layers, 128 for the full ones here; 256 and 512 in the released model) reach the kernel, with scale 1, and
the forward matches the model's torch attention over the paged cache. On a GPU each step that replays a CUDA graph
gives the forward of its step, run eagerly."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint
from diffulex_kernels.attention import paged_attention
from kernel_cases import DEVICE, REPLAY_BOUND, relative_error, replay_against_eager

CANVAS = 8
# Prompts prefilled 16 tokens a forward: the second forward reads the first's cache through the window.
SETTINGS = dict(model_name="diffusion_gemma", block_size=CANVAS, page_size=4, max_model_len=128,
                max_num_batched_tokens=16, num_kv_pages=64, dtype="float32", device=str(DEVICE))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_random_diffusion_gemma_checkpoint(
        tmp_path_factory.mktemp("gemma") / "ckpt", seed=3, head_dim=64, global_head_dim=128, sliding_window=6))


def final_hidden_states(llm: Diffulex, prompt: list[int], forwards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, the final norm's output) of the first `forwards` forwards of one request: its prompt's chunks,
    before any token is sampled, so that both engines feed the same ids."""
    captured = []
    model = llm.model
    pre = model.register_forward_pre_hook(lambda module, args: captured.append([args[0].detach().clone()]))
    post = model.norm.register_forward_hook(lambda module, args, out: captured[-1].append(out.detach().clone()))
    try:
        llm.add_request(prompt, SamplingParams(max_tokens=CANVAS, seed=3, ignore_eos=True))
        while len(captured) < forwards and llm.has_unfinished_requests():
            llm.step()
    finally:
        pre.remove()
        post.remove()
    return [tuple(pair) for pair in captured[:forwards]]


def test_the_kernel_serves_both_layer_kinds_as_the_torch_attention_does(checkpoint):
    prompt = list(range(40, 70))  # five windows: the sliding layers read only the cache's last pages
    reference = Diffulex(checkpoint, **SETTINGS, attention_backend="torch")
    expected = final_hidden_states(reference, prompt, forwards=2)
    kernel = Diffulex(checkpoint, **SETTINGS, attention_backend="torch")
    for layer in kernel.model.layers:  # on a CPU the engine refuses 'triton'; the interpreter runs the kernel
        layer.attn.attention_fn = paged_attention
    got = final_hidden_states(kernel, prompt, forwards=2)
    assert len(got) == len(expected) == 2
    for (ids, out), (ref_ids, ref) in zip(got, expected):
        assert torch.equal(ids, ref_ids)
        # float32 in float32 on both sides; a wrong scale or a missing window is off by the whole.
        assert relative_error(out, ref) < 1e-3


@pytest.mark.skipif(DEVICE.type != "cuda", reason="'auto' takes the kernels on a GPU only; the CPU case is above")
def test_auto_takes_the_kernel_for_diffusion_gemma_on_a_gpu(checkpoint):
    llm = Diffulex(checkpoint, **SETTINGS)
    assert {layer.attn.attention_fn for layer in llm.model.layers} == {paged_attention}
    assert not llm.model.fused_kernels  # the rest of the forward is the torch modules


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU; tests/unit/test_runner_graph_padding.py "
                                                  "checks the padded forward they replay on the CPU, in float64")
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_each_graph_replay_gives_the_eager_forward_of_its_step(tmp_path, experts):
    """The canvas rows, their self-conditioning input and each canvas's random start must reach the replay, step
    after step (kernel_cases.replay_against_eager)."""
    path = str(write_random_diffusion_gemma_checkpoint(tmp_path / "ckpt", seed=3, head_dim=64, global_head_dim=128,
                                                       sliding_window=6, num_experts=experts))
    llm = Diffulex(path, **SETTINGS)
    assert bool(experts) == any(layer.moe is not None for layer in llm.model.layers)
    prompts = [list(range(40, 70)), list(range(5, 12)), list(range(90, 93))]
    params = [SamplingParams(max_tokens=3 * CANVAS, seed=3 + i, ignore_eos=True) for i in range(len(prompts))]
    seen = replay_against_eager(llm, prompts, params)
    assert len(seen.padded) > 5 and max(seen.padded) == 0
    assert max(seen.eager) < REPLAY_BOUND, seen.eager
