"""Attention alone, per backend, against its floors: prefill of long prompts, and one diffusion block over a cached
context, at LLaDA-8B's and Dream-7B's head layouts in bf16.

Phases (the masks the engine's strategies use):
  - prefill: a prompt of T tokens a sequence, no cache, bidirectional (multi_bd's and D2F's prompt);
  - block: a 32-token block a sequence over C cached tokens, which it sees whole, and itself bidirectionally.
Backends, each timed alike (the median of calls launched from Python with the L2 cache cleared before each):
  - triton: the engine's kernel (`diffulex_kernels.paged_attention`) over the paged cache;
  - torch_sdpa: torch's scaled_dot_product_attention over contiguous [batch, heads, tokens, head_dim] tensors
    (torch picks its flash, cuDNN or memory-efficient kernel): the reference a Hopper-tuned kernel should reach;
  - flash_attn_4: FlashAttention's CuTe-DSL kernels (`flash_attn.cute`, the flash-attn-4 package), varlen, over the
    paged cache for blocks, where the package is installed; otherwise its rows say so;
  - flashinfer: FlashInfer's batch prefill wrappers (the flashinfer-python package), non-causal: ragged over the
    prompts' q/k/v, and over the paged cache for blocks (NHD pages, the block's K/V among them); plan() (host-side,
    with the kernels' JIT on first use) outside the timing, run() timed; --flashinfer-backend picks its kernels
    ("auto": FA3 on Hopper) and the note names those that ran; where the package is installed, otherwise its rows
    say so;
  - triton_fp8_kv (blocks only): the engine's kernel over the same cache held as FP8 rows (kv_cache_dtype fp8),
    whose memory floor counts the cached context at head_dim + 4 bytes a row instead of 2 x head_dim;
  - triton_graph and flash_attn_context_graph (blocks only): the engine's two ways of attending a block over its
    context, each replayed from a CUDA graph as decode steps run them (`time_graph_ms`): the Triton kernel whole,
    and attention_backend flash_attn's (flash_attention.FlashAttention): flash-attn-4's paged kernel over the context,
    then the Triton kernel over the block from its output and lse.
Every row gives ms, the compute floor (4 x query-key pairs x heads x head_dim flops / the bf16 matmul rate), the
memory floor (Q, K and V read once and the output written, over the copy bandwidth), the time over the larger floor,
and the output's relative error against torch_sdpa's. Both ceilings are measured in the same run.
Writes attention.csv/.md to --out.

    python benchmarks/attention.py --out DIR        # on a GPU: 1k-32k prompts, blocks over 512-32k contexts
    python benchmarks/attention.py --smoke --out DIR   # anywhere: tiny shapes (CPU: the kernel under the interpreter)
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch
import torch.nn.functional as F

from kernels import (BLOCK_LEN, FULL_MODELS, PAGE_SIZE, SMOKE_MODELS, ModelShape, attention_inputs,  # noqa: E402
                     device_header, measure_ceilings, randn, time_eager_ms, time_graph_ms)
import diffulex_kernels  # noqa: E402
from diffulex_kernels import kv_store  # noqa: E402
from diffulex_backend.attention import AttentionMetadata  # noqa: E402
from diffulex_backend.flash_attention import FlashAttention  # noqa: E402
from result_table import ResultTable  # noqa: E402

FIELDS = ["phase", "model", "batch", "tokens", "context", "backend", "ms", "compute_floor_ms", "memory_floor_ms",
          "vs_floor", "rel_err_vs_sdpa", "note"]
BACKENDS = ("triton", "torch_sdpa", "flash_attn_4", "flashinfer", "triton_fp8_kv", "triton_graph",
            "flash_attn_context_graph")
# FlashInfer's float workspace (its split-KV partial outputs): its wrappers recommend 128 MB; twice that, for 64
# sequences of 28-32 heads.
FLASHINFER_WORKSPACE_BYTES = 256 << 20


def flash_attn_4(device: torch.device):
    """(flash_attn.cute's varlen entry point, None), or (None, why it cannot run here)."""
    if device.type != "cuda":
        return None, "needs a CUDA device"
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None, "not installed"
    return flash_attn_varlen_func, None


def flashinfer(device: torch.device):
    """(the flashinfer package, None), or (None, why it cannot run here)."""
    if device.type != "cuda":
        return None, "needs a CUDA device"
    try:
        import flashinfer as package
    except ImportError as error:
        if error.name == "flashinfer":
            return None, "not installed"
        return None, f"import failed: {type(error).__name__}: {str(error)[:120]}"
    except Exception as error:  # a library it loads on import refuses this machine: the rows say which
        return None, f"import failed: {type(error).__name__}: {str(error)[:120]}"
    return package, None


def prefill_case(model: ModelShape, batch: int, tokens: int, device: torch.device):
    """`batch` prompts of `tokens` tokens, no cache, every token seeing the whole prompt."""
    total = batch * tokens
    cu = tuple(range(0, total + 1, tokens))
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.zeros(batch, dtype=torch.int32, device=device),
        page_tables=torch.zeros(batch, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=device),
        block_ids=torch.zeros(total, dtype=torch.int32, device=device),  # one block: bidirectional
        max_seqlen_q=tokens, max_context_len=0, cu_seqlens_q_host=cu, context_lens_host=(0,) * batch)
    d = model.head_dim
    t = dict(query=randn(total, model.heads, d, device=device), key=randn(total, model.kv_heads, d, device=device),
             value=randn(total, model.kv_heads, d, device=device), k_cache=None, v_cache=None)
    bytes_moved = 2 * total * d * 2 * (model.heads + model.kv_heads)  # q, k, v read, out written, bf16
    flops = 4 * model.heads * d * batch * tokens * tokens
    return t, meta, bytes_moved, flops


def sdpa_inputs(model: ModelShape, t: dict, meta: AttentionMetadata, batch: int):
    """[batch, heads, tokens, head_dim] views for torch: each sequence's cached context (gathered through its page
    table) followed by its fed tokens."""
    q = t["query"].view(batch, -1, model.heads, model.head_dim).transpose(1, 2)
    k, v = t["key"].view(batch, -1, model.kv_heads, model.head_dim), t["value"].view(batch, -1, model.kv_heads,
                                                                                       model.head_dim)
    context = meta.context_lens_host[0]
    if context:
        pages = meta.page_tables[:, :(context + PAGE_SIZE - 1) // PAGE_SIZE].long()
        cached_k = t["k_cache"][pages].flatten(1, 2)[:, :context]
        cached_v = t["v_cache"][pages].flatten(1, 2)[:, :context]
        k, v = torch.cat([cached_k, k], dim=1), torch.cat([cached_v, v], dim=1)
    return q.contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def flashinfer_pages(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page table of a block case, on the host: (kv_indptr, kv_indices, last_page_len). Each sequence
    sees its context and its BLOCK_LEN block tokens, all of them, over the first pages of its page table."""
    seen = [context + BLOCK_LEN for context in meta.context_lens_host]
    pages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in seen]
    page_tables = meta.page_tables.cpu()
    kv_indices = torch.cat([page_tables[i, :n] for i, n in enumerate(pages)])
    kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(seen, pages)], dtype=torch.int32)
    return kv_indptr, kv_indices, last_page_len


def flashinfer_result(model: ModelShape, t: dict, meta: AttentionMetadata, phase: str, flashinfer_pair, scale: float,
                      backend: str = "auto"):
    """FlashInfer's (ms, output in [tokens, heads, head_dim], note). `flashinfer_pair`: flashinfer()'s pair; `backend`:
    its wrappers' ("auto", "fa2" or "fa3"). For blocks, call it after the triton call, which stores the block's K/V
    into the cache."""
    package, missing = flashinfer_pair
    if package is None:
        return float("nan"), None, missing
    query = t["query"]
    # Host tensors: plan() reads the lengths on the host, and copies what run() needs to the device.
    cu = torch.tensor(meta.cu_seqlens_q_host, dtype=torch.int32)
    shape = dict(num_qo_heads=model.heads, num_kv_heads=model.kv_heads, head_dim_qk=model.head_dim, causal=False,
                 sm_scale=scale, q_data_type=query.dtype, kv_data_type=t["key"].dtype)
    try:  # a failure of any kind, running out of memory for the workspace included, ends this row alone
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        if phase == "prefill":
            wrapper = package.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend)
            wrapper.plan(cu, cu, **shape)
            call = lambda: wrapper.run(query, t["key"], t["value"])  # noqa: E731
        else:
            # The block's K/V are in the cache (the triton call stored them). The cache's [num_pages, PAGE_SIZE,
            # kv_heads, head_dim] is FlashInfer's NHD layout as it is.
            wrapper = package.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend)
            wrapper.plan(cu, *flashinfer_pages(meta), page_size=PAGE_SIZE, **shape)
            cache = (t["k_cache"], t["v_cache"])
            call = lambda: wrapper.run(query, cache)  # noqa: E731
        out = call()  # the first run compiles what plan() did not (FA3's page-offset kernel)
        return time_eager_ms(call), out, f"flashinfer {package.__version__}, {getattr(wrapper, '_backend', backend)}"
    except Exception as error:  # a shape, layout or build the package refuses: the row says which
        return float("nan"), None, f"failed: {type(error).__name__}: {str(error)[:120]}"


def run_backends(model: ModelShape, t: dict, meta: AttentionMetadata, batch: int, phase: str, flash_attn,
                 flashinfer_pair, flashinfer_backend: str = "auto"):
    """Per backend: (ms, output in [tokens, heads, head_dim], note). `flash_attn`: flash_attn_4()'s pair;
    `flashinfer_pair`: flashinfer()'s, run with FlashInfer's `flashinfer_backend`."""
    fa4, missing = flash_attn
    scale = model.head_dim ** -0.5
    results = {}
    q, k, v = sdpa_inputs(model, t, meta, batch)
    gqa = model.heads != model.kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    results["torch_sdpa"] = (time_eager_ms(sdpa), sdpa().transpose(1, 2).reshape(t["query"].shape), "")
    args = (t["query"], t["key"], t["value"], t["k_cache"], t["v_cache"], meta, scale)
    results["triton"] = (time_eager_ms(lambda: diffulex_kernels.paged_attention(*args)),
                         diffulex_kernels.paged_attention(*args), "")
    if phase == "block":
        fp8_caches = kv_store.pack_fp8_rows(t["k_cache"]), kv_store.pack_fp8_rows(t["v_cache"])
        fp8_args = (*args[:3], *fp8_caches, *args[5:])
        results["triton_fp8_kv"] = (time_eager_ms(lambda: diffulex_kernels.paged_attention(*fp8_args)),
                                    diffulex_kernels.paged_attention(*fp8_args), "")
    results["flashinfer"] = flashinfer_result(model, t, meta, phase, flashinfer_pair, scale, flashinfer_backend)
    on_gpu = t["query"].is_cuda
    if phase == "block" and on_gpu:
        results["triton_graph"] = (time_graph_ms(lambda: diffulex_kernels.paged_attention(*args, kv_stored=True)),
                                   diffulex_kernels.paged_attention(*args, kv_stored=True), "")
    if fa4 is None:
        results["flash_attn_4"] = (float("nan"), None, missing)
        return results
    if phase == "block" and on_gpu:
        try:
            engine_way = FlashAttention(diffulex_kernels.paged_attention, varlen=fa4, min_context_group=1)
            call = lambda: engine_way(*args, kv_stored=True)  # noqa: E731
            results["flash_attn_context_graph"] = (time_graph_ms(call), call(), "")
        except Exception as error:  # the rows say why
            results["flash_attn_context_graph"] = (float("nan"), None,
                                                   f"failed: {type(error).__name__}: {str(error)[:120]}")
    try:
        if phase == "prefill":
            cu = meta.cu_seqlens_q
            call = lambda: fa4(t["query"], t["key"], t["value"], cu_seqlens_q=cu, cu_seqlens_k=cu,  # noqa: E731
                               max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_q, softmax_scale=scale,
                               causal=False)
        else:
            # The block's K/V are in the cache (the triton call above stored them): the block attends to
            # context + 32 cached keys, all visible.
            seen = meta.context_lens + BLOCK_LEN
            call = lambda: fa4(t["query"], t["k_cache"], t["v_cache"], cu_seqlens_q=meta.cu_seqlens_q,  # noqa: E731
                               seqused_k=seen, max_seqlen_q=BLOCK_LEN,
                               max_seqlen_k=meta.max_context_len + BLOCK_LEN, page_table=meta.page_tables,
                               softmax_scale=scale, causal=False)
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        results["flash_attn_4"] = (time_eager_ms(call), out, "")
    except Exception as error:  # a shape or layout the package refuses: the row says which
        results["flash_attn_4"] = (float("nan"), None, f"failed: {type(error).__name__}: {str(error)[:120]}")
    return results


def relative_error(out: torch.Tensor | None, ref: torch.Tensor) -> float:
    if out is None:
        return float("nan")
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, batch 1 and 2")
    parser.add_argument("--prompts", default="1024,4096,16384,32768", help="prefill tokens a sequence")
    parser.add_argument("--prefill-batches", default="1,8")
    parser.add_argument("--contexts", default="512,2048,8192,32768", help="cached tokens under a block")
    parser.add_argument("--block-batches", default="1,8,64")
    parser.add_argument("--flashinfer-backend", default="auto", choices=("auto", "fa2", "fa3"),
                        help="FlashInfer's kernels: auto picks fa3 on Hopper")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    models = SMOKE_MODELS if args.smoke else FULL_MODELS
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    prompts, prefill_batches = ([16, 40], [1, 2]) if args.smoke else (ints(args.prompts), ints(args.prefill_batches))
    contexts, block_batches = ([0, 40], [1, 2]) if args.smoke else (ints(args.contexts), ints(args.block_batches))
    ceilings = measure_ceilings(device, args.smoke)
    print(device_header(device, ceilings), flush=True)
    fa4, fi = flash_attn_4(device), flashinfer(device)
    args.out.mkdir(parents=True, exist_ok=True)
    table = ResultTable("attention", FIELDS)
    cases = [("prefill", m, b, n) for m, n, b in itertools.product(models, prompts, prefill_batches)]
    cases += [("block", m, b, c) for m, c, b in itertools.product(models, contexts, block_batches)]
    for phase, model, batch, size in cases:
        if phase == "prefill":
            t, meta, bytes_moved, flops = prefill_case(model, batch, size, device)
            tokens, context = size, 0
        else:
            t, meta, bytes_moved, flops = attention_inputs(model, batch, size, device)
            tokens, context = BLOCK_LEN, size
        results = run_backends(model, t, meta, batch, phase, fa4, fi, args.flashinfer_backend)
        compute_ms = 1e3 * flops / ceilings.matmul_rate
        memory_ms = 1e3 * bytes_moved / ceilings.bandwidth
        reference = results["torch_sdpa"][1]
        # The cached context's bytes, which FP8 rows shrink to (head_dim + 4) / (2 head_dim).
        cache_bytes = 2 * batch * context * model.kv_heads * model.head_dim * 2
        fp8_memory_ms = memory_ms - 1e3 * cache_bytes * (1 - (model.head_dim + 4) / (2 * model.head_dim)) \
            / ceilings.bandwidth
        for backend in (b for b in BACKENDS if b in results):
            ms, out, note = results[backend]
            floor_ms = fp8_memory_ms if backend == "triton_fp8_kv" else memory_ms
            table.add(phase=phase, model=model.name, batch=batch, tokens=tokens, context=context, backend=backend,
                      ms=ms, compute_floor_ms=compute_ms, memory_floor_ms=floor_ms,
                      vs_floor=ms / max(compute_ms, floor_ms), rel_err_vs_sdpa=relative_error(out, reference),
                      note=note or str(device))
        del t, meta, results
        if device.type == "cuda":
            torch.cuda.empty_cache()
        table.write(args.out, argv)  # after every case: a run cut off keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
