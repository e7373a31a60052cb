"""DiffusionGemma's layers on the Triton attention kernel: its sliding window and both head sizes (64 for the
sliding layers, 128 for the full ones here; 256 and 512 in the released model) reach the kernel, with scale 1, and
the forward matches the model's torch attention over the paged cache. On a GPU its steps replay CUDA graphs and give
the tokens of eager steps."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.diffusion_gemma_checkpoint import write_random_diffusion_gemma_checkpoint
from diffulex_kernels.attention import paged_attention
from kernel_cases import DEVICE, graph_and_eager_tokens, relative_error

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
    """Every step that replays a graph is run eagerly too, over the same batch: the canvas rows, their
    self-conditioning input and each canvas's random start must reach the replay, step after step. The hidden
    states are compared rather than the tokens: a random model's sampler turns float32 rounding (another GEMM
    kernel for the padded row count) into other tokens, where a missing input is off by the whole."""
    path = str(write_random_diffusion_gemma_checkpoint(tmp_path / "ckpt", seed=3, head_dim=64, global_head_dim=128,
                                                       sliding_window=6, num_experts=experts))
    llm = Diffulex(path, **SETTINGS)
    runner = llm.runner
    graphs = runner.padded_forward
    assert graphs is not None and bool(experts) == any(layer.moe is not None for layer in llm.model.layers)
    replayed = runner.forward
    errors = []

    def forward_twice(batch, lora=None, inputs=None, rows=None):
        hidden = replayed(batch, lora, inputs, rows).clone()
        if graphs.bucket_for(batch) is not None:
            runner.padded_forward = None  # the eager forward; it stores the same K/V again
            try:
                errors.append(relative_error(hidden, replayed(batch, lora, inputs, rows)))
            finally:
                runner.padded_forward = graphs
        return hidden

    runner.forward = forward_twice
    prompts = [list(range(40, 70)), list(range(5, 12)), list(range(90, 93))]
    params = [SamplingParams(max_tokens=3 * CANVAS, seed=3 + i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params)
    assert graphs.graphs and len(errors) > 5
    assert max(errors) < 1e-3, errors  # float32 rounding: about 1e-5 (the CPU torch path gives 2.6e-5)
