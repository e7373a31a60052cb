"""LoRA adapters chosen per request inside the fused forward and its CUDA graphs: the segmented kernels over a
table of fixed length padded with empty segments (what a graph captures) give the torch reference's delta; the
fused forward with adapters gives the torch modules' hidden states, and its rows without an adapter are those of
the forward without adapters; on CUDA a mixed batch replayed in the LoRA graphs gives each request's tokens
alone, eagerly."""
from __future__ import annotations

import json

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.layers.fused_forward import fused_forward
from diffulex_backend.layers.lora import LoraBatch, LoraSegments, LoraStack, add_lora, segment_table
from diffulex_backend.lora import attach_adapters, load_adapter
from diffulex_backend.testing.checkpoint import (random_config, random_model, write_peft_adapter,
                                                 write_random_checkpoint)
from diffulex_kernels.lora import add_lora_segments
from kernel_cases import DEVICE, REL_TOL, generator, randn, relative_error

TARGETS = {"llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"],
           "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "sdar": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)],  # the last: o_proj's partial sums
                         ids=["f32", "bf16", "bf16_into_f32"])
def test_padded_segment_table_gives_the_reference_delta(x_dtype, out_dtype):
    # A bucket of 6 sequences and 40 token rows, 8 rows per sequence at most: sequences 0, 2 and 3 take adapters
    # (3 and 0 under the same one), 1 and 4 none, and the table's last row pads. K = 300: the shrink splits it
    # into shares of 128, the last one ragged.
    rows, k, n, r, adapters, capacity, bound = 40, 300, 80, 16, 3, 6, 8
    gen = generator(5)
    x = randn(rows, k, dtype=x_dtype, gen=gen)
    stack = LoraStack(a=randn(adapters, r, k, dtype=x_dtype, gen=gen) / k ** 0.5,
                      b=randn(adapters, n, r, dtype=x_dtype, gen=gen) / r ** 0.5)
    base = randn(rows, n, dtype=out_dtype, gen=gen)
    batch = LoraBatch(((2, 0, 8), (0, 13, 19), (0, 19, 27)))
    table = segment_table(batch, capacity)
    # The torch reference, in float64 on the CPU.
    reference = add_lora(base.cpu().double(), x.cpu().double(), LoraStack(stack.a.cpu().double(),
                                                                          stack.b.cpu().double()), batch).to(DEVICE)
    out = add_lora_segments(base.clone(), x, stack.a, stack.b, table.to(DEVICE), max_rows=bound)
    covered = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    for _, start, end in batch.segments:
        covered[start:end] = True
    assert torch.equal(out[~covered], base[~covered])  # rows of no segment, padded ones included: untouched
    tolerance = 1e-5 if x_dtype == torch.float32 and DEVICE.type == "cpu" else REL_TOL[x_dtype]
    assert relative_error(out[covered] - base[covered], reference[covered] - base[covered].double()) < tolerance


def metadata(query_lens: list[int], page_tables: list[list[int]], page_size: int) -> AttentionMetadata:
    """A causal prefill of each sequence from position 0, every token stored."""
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    slots = [page_tables[s][p // page_size] * page_size + p % page_size for s, n in enumerate(query_lens)
             for p in range(n)]
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.zeros(len(query_lens), dtype=torch.int32, device=DEVICE),
        page_tables=torch.tensor(page_tables, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_ids=torch.tensor([p for n in query_lens for p in range(n)], dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(query_lens), max_context_len=0, cu_seqlens_q_host=tuple(cu),
        context_lens_host=(0,) * len(query_lens))


@pytest.mark.parametrize("model_name", ["llada", "dream", "sdar"])  # plain, q/k/v bias + GQA, q/k norm
def test_fused_forward_with_adapters_matches_the_torch_modules(model_name, tmp_path):
    shape = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, head_dim=64)
    model = random_model(model_name, **shape, device=DEVICE, seed=11)
    (tmp_path / "config.json").write_text(json.dumps(random_config(model_name, **shape)))
    adapters = [load_adapter(write_peft_adapter(tmp_path / name, tmp_path, targets, rank=rank, seed=seed), model,
                             name, max_rank=8)
                for name, targets, rank, seed in (("full", TARGETS[model_name], 8, 1),
                                                  ("attn", TARGETS[model_name][:3], 4, 2))]
    attach_adapters(model, adapters)
    arch, page_size = model.arch, 4
    # Four sequences of 5, 7, 6 and 3 tokens: "attn", none, "full", "attn".
    query_lens, slots = [5, 7, 6, 3], [1, -1, 0, 1]
    pages = [[0, 1], [2, 3], [4, 5], [6, 7]]
    meta = metadata(query_lens, pages, page_size)
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    batch = LoraBatch(tuple((slot, start, start + n) for slot, start, n in zip(slots, starts, query_lens) if slot >= 0))
    # The table a graph of 8 sequences of up to 8 tokens would hold.
    segments = LoraSegments(segment_table(batch, 8).to(DEVICE), max_rows=8)
    input_ids = torch.randint(0, 258, (sum(query_lens),), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in query_lens]).to(DEVICE)
    caches = [torch.zeros(2, arch.num_layers, 8, page_size, arch.num_kv_heads, arch.head_dim, device=DEVICE)
              for _ in range(3)]
    tolerance = REL_TOL[torch.float32] if DEVICE.type == "cuda" else 1e-5
    with torch.inference_mode():
        want = model(input_ids, positions, meta, caches[0], lora=batch)
        got = fused_forward(model, input_ids, positions, meta, caches[1], lora=segments)
        without = fused_forward(model, input_ids, positions, meta, caches[2])
        base = model(input_ids, positions, meta, None)
    assert relative_error(got, want) < tolerance
    assert relative_error(caches[1], caches[0]) < tolerance  # the K/V stored carry the delta, as the modules'
    plain = slice(starts[1], starts[2])  # the sequence without an adapter: the forward without adapters, exactly
    assert torch.equal(got[plain], without[plain])
    for rows in (slice(starts[0], starts[1]), slice(starts[2], starts[3])):  # the adapters change their rows
        assert relative_error(got[rows], base[rows]) > 0.05


# ---- on CUDA: the graphs ------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
PROMPTS = ["The quick brown fox", "hi", "diffusion language models decode blocks in parallel", "0123456789"]


@pytest.fixture(scope="module")
def checkpoint_with_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_graph")
    # head_dim 64: the Triton attention, so the fused forward and the graphs.
    path = write_random_checkpoint(root / "llada", "llada", seed=7, hidden_size=256, num_heads=4, num_kv_heads=4,
                                   num_layers=2, intermediate_size=512)
    full = write_peft_adapter(root / "full", path, TARGETS["llada"], rank=16, seed=1)
    attn = write_peft_adapter(root / "attn", path, TARGETS["llada"][:3], rank=8, seed=2)
    return str(path), f"full={full},attn={attn}"


def generate(path: str, lora_modules: str | None, prompts: list[str], names: list[str | None], **settings):
    llm = Diffulex(path, block_size=8, page_size=16, max_model_len=128, max_num_reqs=8, buffer_size=2,
                   accept_threshold=0.3, add_block_threshold=0.25, semi_complete_threshold=0.5, dtype="float32",
                   num_kv_pages=64, device="cuda", lora_modules=lora_modules, enable_prefix_caching=False, **settings)
    params = [SamplingParams(max_tokens=48, ignore_eos=True, lora_name=name) for name in names]
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    return tokens, llm.runner.padded_forward


@cuda_only
def test_mixed_batch_replayed_in_lora_graphs_equals_each_request_alone_eagerly(checkpoint_with_adapters):
    path, modules = checkpoint_with_adapters
    names = ["full", "attn", None, "full"]
    together, graphs = generate(path, modules, PROMPTS, names)
    assert any(with_lora for _, with_lora in graphs.graphs), "no step with adapter rows replayed a LoRA graph"
    alone = [generate(path, modules, [prompt], [name], enforce_eager=True)[0][0]
             for prompt, name in zip(PROMPTS, names)]
    assert together == alone
    base, _ = generate(path, modules, PROMPTS[:1], [None])
    assert base[0] != together[0]  # the adapter changed the tokens: the comparison says something


@cuda_only
def test_steps_without_adapter_rows_replay_the_graphs_without_the_delta(checkpoint_with_adapters):
    path, modules = checkpoint_with_adapters
    tokens, graphs = generate(path, modules, PROMPTS, [None] * len(PROMPTS))
    assert graphs.graphs and not any(with_lora for _, with_lora in graphs.graphs)
    without_adapters, _ = generate(path, None, PROMPTS, [None] * len(PROMPTS))
    assert tokens == without_adapters
