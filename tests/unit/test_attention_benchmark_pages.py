"""benchmarks/attention.py hands FlashInfer each block case's page table: read through it, the cache holds every
sequence's keys and values in order, its context then its block, as torch's reference attention sees them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from diffulex_backend.attention import store_kv

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/attention.py as a module (it is a script, beside the modules it imports). Its `kernels` is
    benchmarks/kernels.py, where the suite may have imported the project's kernel package under that name."""
    held = sys.modules.pop("kernels", None)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("attention_benchmark", REPO / "benchmarks" / "attention.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
        sys.modules.pop("kernels", None)
        if held is not None:
            sys.modules["kernels"] = held
    return module


@pytest.mark.parametrize("context", [0, 1, 31, 32, 40, 96])  # pages filled whole, and a page with one row
def test_flashinfer_s_page_table_reads_every_sequence_s_context_then_its_block(bench, context):
    model, batch, page = bench.SMOKE_MODELS[0], 3, bench.PAGE_SIZE
    t, meta, _, _ = bench.attention_inputs(model, batch, context, torch.device("cpu"))
    store_kv(t["key"], t["value"], t["k_cache"], t["v_cache"], meta.slot_mapping)  # as the triton call stores them
    _, want_k, want_v = bench.sdpa_inputs(model, t, meta, batch)  # [batch, kv_heads, context + block, head_dim]
    kv_indptr, kv_indices, last_page_len = bench.flashinfer_pages(meta)
    assert kv_indptr.dtype == last_page_len.dtype == torch.int32 and kv_indptr[0] == 0
    for i in range(batch):
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        rows = (len(pages) - 1) * page + int(last_page_len[i])
        assert rows == context + bench.BLOCK_LEN  # the whole sequence, and no row past its block
        assert len(pages) == -(-rows // page)  # the fewest pages that hold it: FlashInfer reads no page more
        for cache, want in ((t["k_cache"], want_k), (t["v_cache"], want_v)):
            got = cache[pages].flatten(0, 1)[:rows].transpose(0, 1)
            assert torch.equal(got, want[i])
