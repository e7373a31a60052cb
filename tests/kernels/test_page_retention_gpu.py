"""Page retention on CUDA: the fused forward measures the attention each page gets, as the torch modules do, so
the Triton engine keeps the pages the torch engine keeps, and the steps after it replay graphs over the kept
pages."""
from __future__ import annotations

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused forward needs a CUDA device")

PROMPTS = ["a long prompt whose pages are mostly dropped: " * 3, "another, shorter one: " * 4]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True, retention_ratio=0.5),
          SamplingParams(max_tokens=24, ignore_eos=True, retention_ratio=0.3, head_select=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # head_dim 64: the Triton attention, so the fused forward and the graphs.
    return str(write_random_checkpoint(tmp_path_factory.mktemp("retention_gpu"), "llada", seed=5, hidden_size=256,
                                       num_heads=4, num_kv_heads=4, num_layers=2, intermediate_size=512))


def kept_pages(path, attention_backend):
    llm = Diffulex(path, block_size=8, page_size=8, max_model_len=256, max_num_reqs=4, dtype="float32",
                   num_kv_pages=128, device="cuda", attention_backend=attention_backend)
    requests = [llm.requests[llm.add_request(p, q)] for p, q in zip(PROMPTS, PARAMS)]
    while any(r.retention_pending for r in requests):
        llm.step()
    tables = [[page >= 0 for page in r.page_table] for r in requests]
    while llm.has_unfinished_requests():
        llm.step()
    return tables, llm


def test_the_fused_forward_keeps_the_pages_the_torch_modules_keep(checkpoint):
    fused, llm = kept_pages(checkpoint, "triton")
    assert llm.model.fused_kernels and llm.runner.padded_forward.graphs, "no step replayed a graph"
    reference, _ = kept_pages(checkpoint, "torch")
    assert fused == reference
    assert all(not all(kept) for kept in fused)  # pages were dropped
    assert llm.metrics().kv_pages_used == 0
