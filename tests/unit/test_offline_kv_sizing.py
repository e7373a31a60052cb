"""On a GPU, an engine sized by gpu_memory_utilization holds no more of the device than that fraction, at its peak:
once built (its CUDA graphs captured), while it generates, and after. The sizing counts what the steps reserve,
not only what they allocate: the caching allocator's rounding, the graphs' pool, which takes no block the eager
steps freed, the capture stream's own blocks and cuBLAS workspace, and the modules of the kernels the runner loads.
Each of those, left out, takes the engine past its share, and a process beside it that trusts the share runs out of
memory."""

import pytest
import torch

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu_memory_utilization sizes a GPU's pool only")

ROOM = 3e9  # bytes of KV cache and step memory the test gives the engine beyond what the device holds now


def device_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_engine_holds_no_more_than_gpu_memory_utilization_allows_at_its_peak(tmp_path, kv_cache_dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 K/V rows need compute capability 8.9 or newer")
    # Head size 64 and a vocabulary wide enough that a step's logits outweigh its tiny forward.
    checkpoint = write_random_checkpoint(tmp_path / "llada", "llada", hidden_size=256, num_heads=4, num_kv_heads=4,
                                         head_dim=64, intermediate_size=512, vocab_size=32768,
                                         max_position_embeddings=1024)
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(device)[1]
    utilization = (device_used(device) + ROOM) / total
    torch.cuda.reset_peak_memory_stats(device)
    llm = Diffulex(str(checkpoint), device=str(device), dtype="bfloat16", gpu_memory_utilization=utilization,
                   block_size=32, max_num_reqs=16, max_model_len=1024, kv_cache_dtype=kv_cache_dtype)
    allowed = utilization * total

    def peak() -> int:  # the allocator's highest reservation, with what the process holds outside it now
        return torch.cuda.max_memory_reserved(device) + device_used(device) - torch.cuda.memory_reserved(device)

    built = peak()
    prompts = [[(37 * i + n) % 30000 + 1 for i in range(100 + 40 * n)] for n in range(16)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=96, ignore_eos=True, seed=1))
    assert [len(o.token_ids) for o in outputs] == [96] * 16
    # The pool is the share's: sized to the last page, not merely below it.
    page = llm.runner.kv_cache.nbytes / llm.kv_cache.num_pages
    assert llm.runner.kv_cache.nbytes > ROOM / 2
    over = {"once built": built - allowed, "at the peak": peak() - allowed,
            "after generating": device_used(device) - allowed}
    assert all(bytes_over <= 0 for bytes_over in over.values()), (
        f"past gpu_memory_utilization's {allowed / 1e9:.3f} GB by, in pages of {page / 1e6:.1f} MB: "
        + ", ".join(f"{when} {bytes_over / page:.1f}" for when, bytes_over in over.items()))
