"""attention_backend "flash_attn" on the GPU: flash-attn's kernel for dense forwards against the Triton kernel,
attention alone and through a model's forward, and engines that serve with it.

flash-attn computes in bfloat16 here, so these compare within bf16's rounding rather than token for token;
tests/unit/test_dense_attention.py holds the path around the kernel to exact tokens on the CPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import diffulex_kernels
from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import AttentionMetadata, dense_attention_of
from diffulex_backend.flash_attention import FlashAttention, flash_attn_installed
from diffulex_backend.testing.checkpoint import random_model, write_random_checkpoint
from kernel_cases import DEVICE, REL_TOL, generator, randn, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs on a CUDA device")

PAGE_SIZE = 16


def test_the_gpu_set_up_installs_flash_attn_where_the_engine_takes_it():
    # On Hopper and newer `auto` takes flash-attn for prompts; without the package they run about 2.5x slower.
    if torch.cuda.get_device_capability()[0] >= 9:
        assert flash_attn_installed(), "flash-attn-4 is not installed: `make setup-gpu` installs it"


def causal(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)


def full(n: int, block_id: int = 0) -> np.ndarray:
    return np.full(n, block_id, dtype=np.int32)


def with_block(prompt: np.ndarray, block: int = 32) -> np.ndarray:
    return np.concatenate([prompt, full(block, len(prompt))])


FORWARDS = {
    "full": [full(300), full(77)],
    "causal": [causal(300), causal(77), causal(1)],
    "causal-prompt-and-block": [with_block(causal(270)), with_block(causal(45)), full(1)],
    "full-prompt-and-block": [with_block(full(200)), full(33), with_block(full(9))],
}


def dense_forward(block_ids: list[np.ndarray]) -> AttentionMetadata:
    lengths = [len(ids) for ids in block_ids]
    cu = [0, *np.cumsum(lengths).tolist()]
    pages = [-(-n // PAGE_SIZE) for n in lengths]
    first = [0, *np.cumsum(pages).tolist()]
    tables = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(first[b], first[b] + n)
    slots = torch.cat([tables[b, torch.arange(n) // PAGE_SIZE].long() * PAGE_SIZE + torch.arange(n) % PAGE_SIZE
                       for b, n in enumerate(lengths)])
    dense = dense_attention_of(block_ids, 0)
    assert dense is not None
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.zeros(len(lengths), dtype=torch.int32, device=DEVICE), page_tables=tables.to(DEVICE),
        slot_mapping=slots.to(DEVICE), block_ids=torch.from_numpy(np.concatenate(block_ids)).to(DEVICE),
        max_seqlen_q=max(lengths), max_context_len=0, cu_seqlens_q_host=tuple(cu),
        context_lens_host=(0,) * len(lengths), dense=dense.to(DEVICE))


@pytest.mark.parametrize("forward", list(FORWARDS))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 32, 128), (28, 4, 128), (8, 8, 64)])
def test_flash_attn_matches_the_triton_kernel_on_dense_forwards(forward, heads, kv_heads, head_dim):
    meta = dense_forward(FORWARDS[forward])
    tokens = meta.cu_seqlens_q_host[-1]
    gen = generator(5)
    # As the fused projection leaves them: strided views of one [T, q + 2 kv] product.
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, gen=gen)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    num_pages = int(meta.page_tables.max()) + 1
    caches = [torch.zeros(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
              for _ in range(4)]
    scale = head_dim ** -0.5
    want = diffulex_kernels.paged_attention(q, k, v, caches[0], caches[1], dataclasses.replace(meta, dense=None),
                                            scale)
    got = FlashAttention(diffulex_kernels.paged_attention)(q, k, v, caches[2], caches[3], meta, scale)
    assert relative_error(got, want) <= REL_TOL[torch.bfloat16]
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("model_name", ["llada", "dream", "sdar"])  # plain, q/k/v bias + GQA, q/k norm
def test_a_model_forward_on_flash_attn_gives_the_logits_of_the_triton_one(model_name):
    shape = dict(hidden_size=512, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=768, head_dim=128)
    models = []
    for attention in (diffulex_kernels.paged_attention, FlashAttention(diffulex_kernels.paged_attention)):
        model = random_model(model_name, **shape, dtype=torch.bfloat16, device=DEVICE, seed=3, attention_fn=attention)
        model.fused_kernels = True
        models.append(model)
    meta = dense_forward(FORWARDS["causal-prompt-and-block"])
    tokens = meta.cu_seqlens_q_host[-1]
    input_ids = torch.randint(0, models[0].arch.vocab_size, (tokens,), device=DEVICE)
    positions = torch.cat([torch.arange(len(ids)) for ids in FORWARDS["causal-prompt-and-block"]]).to(DEVICE)
    logits = []
    for model, dense in zip(models, (None, meta.dense)):
        cache = torch.zeros(2, 2, int(meta.page_tables.max()) + 1, PAGE_SIZE, 2, 128, dtype=torch.bfloat16,
                            device=DEVICE)
        with torch.inference_mode():
            hidden = model(input_ids, positions, dataclasses.replace(meta, dense=dense), cache)
            logits.append(model.compute_logits(hidden).float())
    assert relative_error(logits[1], logits[0]) <= 2 * REL_TOL[torch.bfloat16]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def decode_with_each_backend(path, strategy: str) -> dict[str, int]:
    """Engines with attention_backend triton and flash_attn decode two prompts, 64 greedy tokens each, with every
    page back; returns flash_attn's launches of flash-attn counted: dense, paged, and paged while a CUDA graph
    captured (every layer shares one attention function; no warm-up, so that every graph is captured after the
    count starts). bf16: the two kernels round differently, and a random model's near-ties may then decode apart
    later on, so the tokens' first difference is printed, not asserted."""
    prompts = ["a prompt long enough to fill a few pages of the cache " * 8, "hi"]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    outputs, calls = {}, {"dense": 0, "paged": 0, "paged_captured": 0}
    for backend in ("triton", "flash_attn"):
        engine = Diffulex(str(path), attention_backend=backend, decoding_strategy=strategy, num_kv_pages=64,
                          max_model_len=512, warm_up=False)
        assert engine.resolved_settings()["attention_backend"] == backend
        if backend == "flash_attn":
            attention = engine.model.layers[0].attn.attention_fn
            varlen = attention.varlen

            def counted(*args, **kwargs):
                paged = kwargs.get("page_table") is not None
                calls["paged" if paged else "dense"] += 1
                calls["paged_captured"] += paged and torch.cuda.is_current_stream_capturing()
                return varlen(*args, **kwargs)

            attention.varlen = counted
        outputs[backend] = [out.token_ids for out in engine.generate(prompts, params)]
        assert engine.metrics().kv_pages_used == 0
        del engine
        torch.cuda.empty_cache()
    for got, want in zip(outputs["flash_attn"], outputs["triton"]):
        assert len(got) == len(want) == 64
        print(f"{strategy}: flash_attn's tokens first differ from triton's at {first_difference(got, want)}")
    return calls


@pytest.mark.parametrize("strategy", ["multi_bd", "vanilla"])
def test_an_engine_on_flash_attn_serves_prompts_beside_the_triton_one(tmp_path, strategy):
    """One query head a kv head: flash-attn takes the prompts, and the Triton kernel every cached context."""
    path = write_random_checkpoint(tmp_path / "llada", "llada", hidden_size=512, num_layers=2, num_heads=4,
                                   num_kv_heads=4, intermediate_size=768, head_dim=128)
    calls = decode_with_each_backend(path, strategy)
    assert calls["dense"] >= 2 and calls["paged"] == 0  # the model's two layers, at least once


def blocks_over_contexts(heads: int, kv_heads: int, contexts: list[int], in_flight: list[int], seed: int,
                         columns: int = 140):
    """q, k, v, (k_cache, v_cache) and the metadata of blocks over cached contexts: sequence b feeds in_flight[b]
    blocks of 32 (block-causal, none of them stored) over contexts[b] cached tokens, with page tables of `columns`
    pages, as a CUDA graph's are as wide as max_model_len."""
    gen = generator(seed)
    block, head_dim = 32, 128
    num_pages = columns * len(contexts)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    tables = order.view(len(contexts), columns).to(torch.int32)
    for b, (context, n) in enumerate(zip(contexts, in_flight)):  # -1 past each sequence's pages, as an engine's
        tables[b, -(-(context + block * n) // PAGE_SIZE):] = -1
    lengths = [block * n for n in in_flight]
    cu = [0, *np.cumsum(lengths).tolist()]
    block_ids = np.concatenate([context + np.arange(n) // block * block for context, n in zip(contexts, lengths)])
    tokens = cu[-1]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE), page_tables=tables.to(DEVICE),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=DEVICE),
        block_ids=torch.from_numpy(block_ids.astype(np.int32)).to(DEVICE), max_seqlen_q=max(lengths),
        max_context_len=columns * PAGE_SIZE, cu_seqlens_q_host=tuple(cu), context_lens_host=tuple(contexts))
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, gen=gen)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    caches = [randn(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    return q, k, v, caches, meta


@pytest.mark.parametrize("heads, kv_heads", [(28, 4), (32, 8), (32, 32)])
def test_flash_attn_s_context_then_the_in_forward_keys_match_the_triton_kernel_eager_and_in_a_graph(heads, kv_heads):
    """flash-attn's paged kernel over the cached context, then the Triton kernel over the in-forward keys from its
    output and lse, against the Triton kernel over both: eagerly, and replayed from a CUDA graph after the batch's
    contexts and blocks changed in place (the engine's graphs serve every batch of their bucket that way)."""
    attention = FlashAttention(diffulex_kernels.paged_attention, min_context_group=1)
    q, k, v, caches, meta = blocks_over_contexts(heads, kv_heads, [700, 0, 33, 2048], [2, 1, 1, 2], seed=heads)
    scale = 128 ** -0.5
    want = diffulex_kernels.paged_attention(q, k, v, *caches, meta, scale, kv_stored=True)
    got = attention(q, k, v, *caches, meta, scale, kv_stored=True)
    assert attention.takes_context(q, k, caches[0], meta)
    assert relative_error(got, want) <= REL_TOL[torch.bfloat16]

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention(q, k, v, *caches, meta, scale, kv_stored=True)
    _, _, _, _, other = blocks_over_contexts(heads, kv_heads, [5, 1500, 0, 64], [1, 2, 2, 1], seed=heads + 1)
    for name in ("context_lens", "page_tables", "block_ids"):
        getattr(meta, name).copy_(getattr(other, name))
    meta.cu_seqlens_q.copy_(other.cu_seqlens_q)
    graph.replay()
    replayed = diffulex_kernels.paged_attention(q, k, v, *caches, other, scale, kv_stored=True)
    assert relative_error(captured, replayed) <= REL_TOL[torch.bfloat16]


def test_an_engine_whose_wide_groups_read_their_context_with_flash_attn_decodes_beside_the_triton_one(tmp_path):
    """A Dream layout of 4 query heads a kv head under d2f (blocks in flight) with CUDA graphs: flash-attn's paged
    kernel reads the cached contexts, and the Triton kernel goes on over the blocks."""
    path = write_random_checkpoint(tmp_path / "dream", "dream", hidden_size=1024, num_layers=2, num_heads=8,
                                   num_kv_heads=2, intermediate_size=768, head_dim=128)
    assert decode_with_each_backend(path, "d2f")["paged_captured"] > 0
