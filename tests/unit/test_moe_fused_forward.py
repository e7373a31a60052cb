"""The MoE families' CUDA forward (`layers.fused_forward`: the fused-MoE kernel for the routed experts, partial
rotary in the RoPE launch, the dense first layer on the dense kernels) gives the hidden states and the paged
cache of the torch modules. On a machine without a GPU the kernels run under TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, random_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE_SIZE = 4
# float32 throughout; on the GPU the matrix products run in tf32.
TOLERANCE = 2e-2 if DEVICE.type == "cuda" else 1e-5

pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def metadata(query_lens, context_lens, slot_mapping, page_tables) -> AttentionMetadata:
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    # Block ids: a prefill (no context) is causal, one block per token; a decode step is one block over its context.
    block_ids = [i if c == 0 else c for n, c in zip(query_lens, context_lens) for i in range(n)]
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    return AttentionMetadata(
        cu_seqlens_q=as_tensor(cu, torch.int32), context_lens=as_tensor(context_lens, torch.int32),
        page_tables=as_tensor(page_tables, torch.int32), slot_mapping=as_tensor(slot_mapping, torch.int64),
        block_ids=as_tensor(block_ids, torch.int32), max_seqlen_q=max(query_lens),
        max_context_len=max(context_lens), cu_seqlens_q_host=tuple(cu), context_lens_host=tuple(context_lens))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("shared_experts", ["among the routed", "dense"])
@pytest.mark.parametrize("model_name", ["llada2", "sdar_moe"])  # partial rotary + groups + shared; softmax router
def test_fused_forward_of_a_moe_model_matches_the_torch_modules(model_name, shared_experts, monkeypatch):
    """LLaDA2's shared expert runs in the fused-MoE kernel's launches at these few tokens, or, with that bound set
    to 0, as the dense MLP that larger batches take; SDAR-MoE has none."""
    import diffulex_kernels
    from diffulex_backend.layers import fused_forward
    from diffulex_backend.layers.moe import MoE

    if shared_experts == "dense":
        monkeypatch.setattr(fused_forward, "SHARED_AMONG_ROUTED_MAX_TOKENS", 0)

    # head_dim 64: the attention kernel's smallest; LLaDA2 then rotates the first 32 dims of each head.
    shape = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=64)
    reference = random_model(model_name, **shape, device=DEVICE, seed=11)
    fused = random_model(model_name, **shape, device=DEVICE, seed=11, attention_fn=diffulex_kernels.paged_attention)
    fused.fused_kernels = True
    arch = reference.arch
    # The way asked for is the way taken, at both steps' token counts (15 and 16).
    for layer in fused.layers:
        if isinstance(layer.mlp, MoE) and layer.mlp.shared_experts is not None:
            for tokens in (15, 16):
                among_routed = fused_forward._shared_among_routed(layer.mlp, tokens)
                assert (among_routed is not None) == (shared_experts == "among the routed")
    caches = [torch.zeros(2, arch.num_layers, 8, PAGE_SIZE, arch.num_kv_heads, arch.head_dim, device=DEVICE)
              for _ in range(2)]
    pages = [[0, 1, 2, 3], [4, 5, 6, 7]]
    slots = lambda seq, n: [pages[seq][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(n)]  # noqa: E731
    # A causal prefill of two prompts (6 and 9 tokens) that stores every token, then an 8-token block per
    # sequence over that cached context.
    prefill = metadata([6, 9], [0, 0], slots(0, 6) + slots(1, 9), pages)
    decode = metadata([8, 8], [6, 9], [-1] * 16, pages)
    gen = torch.Generator().manual_seed(3)
    steps = [
        (torch.randint(0, 258, (15,), generator=gen), torch.cat([torch.arange(6), torch.arange(9)]), prefill),
        (torch.full((16,), MASK_TOKEN_ID), torch.cat([torch.arange(6, 14), torch.arange(9, 17)]), decode),
    ]
    with torch.inference_mode():
        for input_ids, positions, meta in steps:
            want = reference(input_ids.to(DEVICE), positions.to(DEVICE), meta, caches[0])
            got = fused(input_ids.to(DEVICE), positions.to(DEVICE), meta, caches[1])
            assert relative_error(got, want) < TOLERANCE
    assert relative_error(caches[1], caches[0]) < TOLERANCE


@pytest.mark.parametrize("tokens", [8, 70], ids=["streamed", "past-MAX_TOKENS"])  # MAX_TOKENS is 64
def test_the_router_of_a_16_bit_model_is_float32_as_the_torch_router(tokens):
    """The fused forward's router takes a 16-bit model's rows and weight as they are: up to MAX_TOKENS rows the
    streaming kernel's split product, whose products of bf16 values are exact in float32 and whose partial sums are
    float32, past them one product in float32. Either way the logits are the torch router's (x and the weight
    widened to float32, then multiplied) up to float32's sums, each expert in its own column."""
    import torch.nn.functional as F

    from diffulex_backend.layers import fused_forward
    from diffulex_backend.layers.moe import MoE

    shape = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=64)
    model = random_model("llada2", **shape, dtype=torch.bfloat16, device=DEVICE, seed=12)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(tokens, shape["hidden_size"], generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    with torch.inference_mode():
        partials = fused_forward._router_logits(moe, x)
    want = F.linear(x.float(), moe.gate.weight.float())
    assert partials.dtype == torch.float32 and partials.shape[1:] == want.shape
    assert relative_error(partials.sum(0), want) < 1e-6


def test_a_block_scaled_release_runs_its_shared_expert_among_the_routed_as_its_dense_mlp_computes_it(
        tmp_path, monkeypatch):
    """A LLaDA2 release in FP8 with block scales (DeepSeek-V3's weight_scale_inv layout, blocks of 32 so that every
    product has several column groups): its shared expert's weights and scales are whole experts of the stacks', so
    at a decode step's few tokens it runs among the routed experts, in the fused-MoE kernel's launches, with its own
    scale per row and column group. The forward is the one that runs it as the dense MLP (the bound set to 0): both
    ways cast the tokens to fp8 once and take W8A8 products, which the interpreter forms in float32, so they agree
    to float32 rounding on the CPU and to the rounding of the GPU's products there. The shared expert's down scales
    with their column groups in reverse order took this forward 7% away. (The release's dequantized twin, which
    `write_fp8_pair` writes beside it, is not read here.)"""
    import diffulex_kernels
    from diffulex_backend.layers import fused_forward
    from diffulex_backend.layers.moe import MoE
    from diffulex_backend.loader import load_model
    from diffulex_backend.testing.checkpoint import write_random_checkpoint

    from fp8_checkpoints import write_fp8_pair

    shape = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=64,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, num_shared_experts=1,
                 num_expert_groups=1, topk_groups=1)
    source = write_random_checkpoint(tmp_path / "llada2", "llada2", seed=12, **shape)
    write_fp8_pair(source, tmp_path / "fp8", tmp_path / "float", (32, 32))
    model = load_model(tmp_path / "fp8", device=DEVICE, attention_fn=diffulex_kernels.paged_attention)
    model.fused_kernels = True
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    assert moe.w_down_scale.shape[-1] == 2 and moe.shared_experts.down_proj.weight_scale.shape[-1] == 2
    assert fused_forward._shared_among_routed(moe, 16) is not None
    arch = model.arch
    pages = [[0, 1, 2, 3], [4, 5, 6, 7]]
    slots = lambda seq, n: [pages[seq][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(n)]  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    steps = [  # a causal prefill of two prompts, then an 8-token block per sequence over that context
        (torch.randint(0, 258, (15,), generator=gen), torch.cat([torch.arange(6), torch.arange(9)]),
         metadata([6, 9], [0, 0], slots(0, 6) + slots(1, 9), pages)),
        (torch.full((16,), MASK_TOKEN_ID), torch.cat([torch.arange(6, 14), torch.arange(9, 17)]),
         metadata([8, 8], [6, 9], [-1] * 16, pages)),
    ]

    ways = []  # how each MoE launch took the shared expert: among the routed, or its dense MLP's partial sums
    fused_moe = fused_forward.fused_moe

    def spied_fused_moe(*args, shared_experts=None, shared=None, **kwargs):
        ways.append("among the routed" if shared_experts is not None else "dense" if shared is not None else "none")
        return fused_moe(*args, shared_experts=shared_experts, shared=shared, **kwargs)

    monkeypatch.setattr(fused_forward, "fused_moe", spied_fused_moe)

    def run() -> list[torch.Tensor]:
        cache = torch.zeros(2, arch.num_layers, 8, PAGE_SIZE, arch.num_kv_heads, arch.head_dim, device=DEVICE)
        ways.clear()
        with torch.inference_mode():
            return [model(ids.to(DEVICE), pos.to(DEVICE), meta, cache) for ids, pos, meta in steps]

    among_routed = run()
    assert ways == ["among the routed"] * 2  # the prefill's 15 tokens and the block's 16
    monkeypatch.setattr(fused_forward, "SHARED_AMONG_ROUTED_MAX_TOKENS", 0)
    dense = run()
    assert ways == ["dense"] * 2
    for got, want in zip(among_routed, dense):
        assert relative_error(got, want) < TOLERANCE
