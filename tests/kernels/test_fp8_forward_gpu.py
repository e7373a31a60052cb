"""FP8 weights through the CUDA forward: the fused forward's W8A8 products stay within a stated bound of the float
forward of the same (dequantized) weights; and the engine's CUDA graph replays give the forward of their steps,
dense and MoE."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.fp8_linear import Fp8Linear, dequantize_weight
from diffulex_backend.quantization import quantize_model
from diffulex_backend.testing.checkpoint import random_model, write_random_checkpoint
from kernel_cases import FP8_REPLAY_BOUND, REPLAY_BOUND, replay_against_eager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused forward needs a CUDA device")

SHAPE = dict(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=8, intermediate_size=1024, head_dim=64)
# Each e4m3 activation is within 2^-4 of itself, and with random signs a product's relative error is about the
# rms of that rounding, 2^-4 / sqrt(3) = 3.6% (tests/kernels/test_fp8_kernels.py holds one product to 2^-4). The
# random checkpoints' attention is sharp (scores of std ~4), which multiplies the q and k errors through the
# softmax: the same forward on the CPU, with torch's cast in place of the kernel's and float32 weights, is 0.141 to
# 0.146 off at the last hidden state over four inputs. bf16 adds a few tenths of a percent; 0.2 leaves room for it.
HIDDEN_BOUND = 0.2
# The engines of the graph-against-eager tests.
ENGINE = dict(block_size=8, page_size=8, max_model_len=256, max_num_reqs=4, num_kv_pages=64, device="cuda",
              dtype="float32", attention_backend="triton")


def metadata(tokens: int) -> AttentionMetadata:
    device = torch.device("cuda")
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([0], dtype=torch.int32, device=device),
        page_tables=torch.arange(8, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(tokens, device=device),
        block_ids=torch.arange(tokens, dtype=torch.int32, device=device), max_seqlen_q=tokens, max_context_len=0,
        cu_seqlens_q_host=(0, tokens), context_lens_host=(0,))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_fp8_fused_forward_is_within_the_stated_bound_of_the_dequantized_float_forward():
    fp8 = random_model("llada", **SHAPE, dtype=torch.bfloat16, device="cuda", seed=7,
                       attention_fn=diffulex_kernels.paged_attention)
    quantize_model(fp8)
    fp8.fused_kernels = True
    twin = random_model("llada", **SHAPE, dtype=torch.bfloat16, device="cuda", seed=7)
    with torch.no_grad():
        for name, module in fp8.named_modules():
            if isinstance(module, Fp8Linear):
                twin.get_submodule(name).weight.copy_(dequantize_weight(module.weight, module.weight_scale))
    arch, tokens = fp8.arch, 32
    caches = [torch.zeros(2, arch.num_layers, 8, 8, arch.num_kv_heads, arch.head_dim, dtype=torch.bfloat16,
                          device="cuda") for _ in range(2)]
    ids = torch.randint(0, 256, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    positions = torch.arange(tokens, device="cuda")
    with torch.inference_mode():
        got = fp8(ids, positions, metadata(tokens), caches[0])
        want = twin(ids, positions, metadata(tokens), caches[1])
        error = relative_error(got, want)
        logits_error = relative_error(fp8.compute_logits(got), twin.compute_logits(want))
    print(f"fp8 W8A8 vs dequantized bf16: hidden {error:.4f}, logits {logits_error:.4f}")
    assert error < HIDDEN_BOUND, f"hidden states off by {error:.4f}, logits by {logits_error:.4f}"


def test_fp8_engine_graph_replays_give_the_forward_of_their_steps(tmp_path):
    path = str(write_random_checkpoint(tmp_path / "llada", "llada", seed=5, **SHAPE))
    llm = Diffulex(path, **ENGINE, quantization="fp8")
    try:
        assert llm.model.fused_kernels and any(p.dtype == torch.float8_e4m3fn for p in llm.model.parameters())
        seen = replay_against_eager(llm, ["fp8 on the GPU", "a second prompt, longer than the first one"],
                                    SamplingParams(max_tokens=48, ignore_eos=True))
    finally:
        llm.close()
    assert max(seen.padded) == 0
    assert max(seen.eager) < FP8_REPLAY_BOUND, seen.eager


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["float experts", "fp8 experts"])
def test_moe_graph_replays_give_the_forward_of_their_steps(tmp_path, quantization):
    """A CUDA graph's padding rows hold garbage, NaN included: the router must keep a NaN row's choice among the
    experts, or the expert kernels write past their stacks (float and fp8 stacks alike, at this shape)."""
    path = str(write_random_checkpoint(tmp_path / "llada2", "llada2", seed=5, **SHAPE, num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=128, num_expert_groups=1,
                                       topk_groups=1, dense_layers=(0,)))
    llm = Diffulex(path, **ENGINE, quantization=quantization)
    try:
        assert any(p.dtype == torch.float8_e4m3fn and p.dim() == 3 for p in llm.model.parameters()) == (
            quantization == "fp8")
        seen = replay_against_eager(llm, ["fp8 experts on the GPU", "a second prompt, longer than the first one"],
                                    SamplingParams(max_tokens=48, ignore_eos=True))
    finally:
        llm.close()
    assert max(seen.padded) == 0
    assert max(seen.eager) < (FP8_REPLAY_BOUND if quantization else REPLAY_BOUND), seen.eager
