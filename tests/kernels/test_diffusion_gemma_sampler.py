"""DiffusionGemma's sampler on the canvas sampling kernels (soft cap and temperature formed from the head's raw
product) gives the torch reference's sample, argmax, entropy and self-conditioning input for every row, at the
temperatures of its schedule; and over chunks of rows, the values of one pass over all of them."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend.sampling import row_keys, uniform_noise
from diffulex_backend.strategies import diffusion_gemma as strategy
from diffulex_backend.testing.diffusion_gemma_checkpoint import random_diffusion_gemma, tiny_config
from diffulex_kernels.canvas_sampling import canvas_probs_, canvas_statistics
from diffulex_kernels.sampling import SamplerLaunch
from kernel_cases import DEVICE, FULL_SHAPES, generator, randn, relative_error

VOCAB = 262144 if FULL_SHAPES else 3000  # the released vocabulary on a GPU; a ragged last tile under the interpreter
ROWS = 64 if FULL_SHAPES else 10


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def model(request):
    return random_diffusion_gemma(tiny_config(vocab_size=VOCAB), "gemma", seed=5, dtype=request.param, device=DEVICE)


def rows(model, seed: int):
    gen = generator(seed)
    hidden = randn(ROWS, model.arch.hidden_size, dtype=model.embed_tokens.weight.dtype, gen=gen)
    # The schedule's temperatures, from t_max at the first step to t_min at the last.
    temps = torch.linspace(0.8, 0.4, ROWS, device=DEVICE, dtype=torch.float64)
    positions = torch.arange(ROWS, device=DEVICE)
    keys = row_keys(torch.full((ROWS,), seed, device=DEVICE), positions, positions % 3)
    return hidden, temps, keys


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_path_gives_the_reference_s_statistics(model, seed):
    hidden, temps, keys = rows(model, seed)
    with torch.inference_mode():
        fused = strategy.row_statistics(model, hidden, temps, keys, use_kernel=True)
        reference = strategy.row_statistics(model, hidden, temps, keys, use_kernel=False)
    assert torch.equal(fused.sampled, reference.sampled)
    assert torch.equal(fused.argmax, reference.argmax)
    # Samples differ from the argmax somewhere: the noise reached the kernel's choice.
    assert not torch.equal(fused.sampled, fused.argmax)
    torch.testing.assert_close(fused.entropy, reference.entropy, rtol=1e-4, atol=1e-5)
    # The distribution from the kernel's logsumexp and its tanh: float32 rounding over the whole of each row; in
    # bf16 both round it to bf16 for the embedding's product, from float32 values a rounding apart.
    tolerance = 1e-5 if model.embed_tokens.weight.dtype == torch.float32 else 1e-2
    assert relative_error(fused.soft, reference.soft) < tolerance


def test_chunks_of_rows_give_the_values_of_one_pass(model, monkeypatch):
    hidden, temps, keys = rows(model, 2)
    with torch.inference_mode():  # the kernel path, as a GPU takes it (the interpreter runs it on a CPU)
        whole = strategy.row_statistics(model, hidden, temps, keys, use_kernel=True)
        monkeypatch.setattr(strategy, "SAMPLER_CHUNK_ELEMENTS", 3 * VOCAB)  # chunks of 3 rows, the last of 1
        chunked = strategy.chunked_row_statistics(model, hidden, temps, keys, use_kernel=True)
    assert torch.equal(chunked.sampled, whole.sampled) and torch.equal(chunked.argmax, whole.argmax)
    # The logits' product takes its rows in other blocks: the floats agree to rounding, not bit for bit.
    for whole_field, chunked_field in zip(whole[2:], chunked[2:]):
        assert chunked_field.shape == whole_field.shape
        torch.testing.assert_close(chunked_field, whole_field, rtol=1e-4, atol=1e-4)


def scores_reference(raw: torch.Tensor, temps: torch.Tensor, cap: float | None) -> torch.Tensor:
    s = raw.float()
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    return s / temps[:, None]


@pytest.mark.parametrize("launch", [None, SamplerLaunch(block_v=512, num_warps=4, num_chunks=3)],
                         ids=["planned", "three chunks"])
@pytest.mark.parametrize("cap", [30.0, None], ids=["capped", "uncapped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_statistics_and_the_distribution_are_those_of_the_capped_tempered_scores(launch, cap, dtype):
    gen = generator(11)
    vocab = VOCAB + 37  # a ragged last tile, and under three chunks a ragged last chunk
    raw = (randn(ROWS, vocab, dtype=torch.float32, gen=gen) * 20).to(dtype)  # past the cap: tanh saturates
    temps = torch.linspace(0.8, 0.4, ROWS, device=DEVICE)
    keys = row_keys(torch.full((ROWS,), 11, device=DEVICE), torch.arange(ROWS, device=DEVICE),
                    torch.zeros(ROWS, dtype=torch.int64, device=DEVICE))
    stats = canvas_statistics(raw, temps, keys, cap, launch=launch)
    s = scores_reference(raw, temps, cap)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, vocab)))
    assert torch.equal(stats.sampled, (s + gumbel).argmax(-1))
    assert torch.equal(stats.argmax, s.argmax(-1))
    log_probs = torch.log_softmax(s, -1)
    torch.testing.assert_close(stats.entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.logsumexp, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    probs = canvas_probs_(raw, temps, stats.logsumexp, cap)
    assert probs.data_ptr() == raw.data_ptr() and probs.dtype == dtype  # over the logits, in their dtype
    tolerance = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]  # one rounding to the dtype
    assert relative_error(probs, log_probs.exp()) < tolerance


@pytest.mark.parametrize("launch", [None, SamplerLaunch(block_v=512, num_warps=4, num_chunks=3)],
                         ids=["planned", "three chunks"])
@pytest.mark.parametrize("cap", [30.0, None], ids=["capped", "uncapped"])
def test_the_entropy_is_not_finite_for_the_same_rows_in_the_kernel_and_the_torch_sampler(model, monkeypatch, launch,
                                                                                          cap):
    """The runner ends a canvas whose entropy is not finite. Both samplers give a row holding a NaN a non-finite
    entropy, and so a row with +inf or one of -inf throughout where no cap bounds them; a cap maps infinities to its
    bounds, and a -inf among finite logits is a token never drawn: those rows' entropies are finite."""
    gen = generator(13)
    dtype = model.embed_tokens.weight.dtype
    raw = (randn(ROWS, VOCAB, dtype=torch.float32, gen=gen) * 4).to(dtype)
    raw[1, VOCAB - 2] = float("nan")
    raw[2, 7] = float("inf")
    raw[3] = float("-inf")
    raw[4, 11] = float("-inf")
    temps = torch.linspace(0.8, 0.4, ROWS, device=DEVICE)
    keys = row_keys(torch.full((ROWS,), 13, device=DEVICE), torch.arange(ROWS, device=DEVICE),
                    torch.zeros(ROWS, dtype=torch.int64, device=DEVICE))
    kernel = canvas_statistics(raw, temps, keys, cap, launch=launch).entropy
    # The torch sampler over the same logits, capped as the model's compute_logits caps them.
    capped = raw if cap is None else (torch.tanh(raw.float() / cap) * cap).to(dtype)
    monkeypatch.setattr(model, "compute_logits", lambda hidden: capped)
    hidden = randn(ROWS, model.arch.hidden_size, dtype=dtype, gen=gen)
    with torch.inference_mode():
        reference = strategy.row_statistics(model, hidden, temps, keys, use_kernel=False).entropy
    expected = [True, False, cap is not None, cap is not None] + [True] * (ROWS - 4)
    assert kernel.isfinite().tolist() == reference.isfinite().tolist() == expected


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
def test_a_hidden_row_of_nan_gives_that_row_alone_a_non_finite_entropy(model, use_kernel):
    hidden, temps, keys = rows(model, 3)
    hidden[2] = float("nan")
    with torch.inference_mode():
        stats = strategy.row_statistics(model, hidden, temps, keys, use_kernel=use_kernel)
    assert (~stats.entropy.isfinite()).nonzero().flatten().tolist() == [2]
