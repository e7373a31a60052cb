"""The fused forward of an FP8 model (under TRITON_INTERPRET=1 on the CPU, compiled on a GPU): the norms that cast
their rows for the fp8 qkv and gate_up projections as they write them give the forward, bit for bit, that casting
those rows in launches of their own gives; dense and MoE layers, over a prefill and a cached decode step."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels
from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers import fused_forward
from diffulex_backend.quantization import quantize_model
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID, random_model
from kernel_cases import DEVICE


def metadata(query_lens, context_lens, block_ids, slot_mapping) -> AttentionMetadata:
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    return AttentionMetadata(
        cu_seqlens_q=as_tensor(cu, torch.int32), context_lens=as_tensor(context_lens, torch.int32),
        page_tables=as_tensor([[0, 1, 2, 3]], torch.int32), slot_mapping=as_tensor(slot_mapping, torch.int64),
        block_ids=as_tensor(block_ids, torch.int32), max_seqlen_q=max(query_lens),
        max_context_len=max(context_lens), cu_seqlens_q_host=tuple(cu), context_lens_host=tuple(context_lens))


@pytest.mark.parametrize("model_name,extra", [
    ("llada", {}),
    ("llada2", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, num_expert_groups=1,
                    topk_groups=1)),  # a dense first layer, then a MoE layer whose experts read fp8 stacks
], ids=["dense", "moe"])
def test_norms_casting_their_rows_give_the_forward_of_separate_casts(monkeypatch, model_name, extra):
    shape = dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128, head_dim=64)
    model = random_model(model_name, **shape, **extra, device=DEVICE, seed=3,
                         attention_fn=diffulex_kernels.paged_attention)
    quantize_model(model)
    model.fused_kernels = True
    arch = model.arch
    gen = torch.Generator().manual_seed(4)
    steps = [  # a causal prefill of 9 tokens that stores them, then a 4-token block over that context
        (torch.randint(0, 258, (9,), generator=gen), torch.arange(9), metadata([9], [0], list(range(9)), list(range(9)))),
        (torch.full((4,), MASK_TOKEN_ID), torch.arange(9, 13), metadata([4], [9], [9] * 4, [-1] * 4)),
    ]

    def run() -> list[torch.Tensor]:
        cache = torch.zeros(2, arch.num_layers, 4, 4, arch.num_kv_heads, arch.head_dim, device=DEVICE)
        with torch.inference_mode():
            return [model(ids.to(DEVICE), pos.to(DEVICE), meta, cache) for ids, pos, meta in steps]

    assert fused_forward._takes_fp8_rows(model.layers[0].attn.qkv_proj, None, None)
    fused = run()
    # Every projection then casts its own input with quantize_rows.
    monkeypatch.setattr(fused_forward, "_takes_fp8_rows", lambda *args: False)
    separate = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, separate))
