"""On a GPU, an engine sized by gpu_memory_utilization holds no more of the device than that fraction, at its peak:
once built (its CUDA graphs captured), while it generates, and after. The sizing counts what the steps reserve,
not only what they allocate: the caching allocator's rounding, the graphs' pool, which takes no block the eager
steps freed, the capture stream's own blocks and cuBLAS workspace, and the modules of the kernels the runner loads.
Each of those, left out, takes the engine past its share, and a process beside it that trusts the share runs out of
memory.

Every family whose forward or step differs in what it allocates sizes itself the same way: its own largest step
and a trial capture of its own graph (DMax's soft inputs, the MoE experts, DiffusionGemma's per-layer cache and
canvas sampler, Fast-dLLM v2's sub-blocks, LoRA's adapter stacks), so each is held to the share here."""

import gc

import pytest
import torch

from families import MODELS, model_settings, write_adapter, write_checkpoint

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.cuda_graph import CUDAGraphForward
from diffulex_backend.testing.checkpoint import write_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu_memory_utilization sizes a GPU's pool only")

ROOM = 3e9  # bytes of KV cache and step memory the test gives the engine beyond what the device holds now
# Each family whose step or graph allocates differently, with the strategy whose step it runs (families.MODELS).
FAMILIES = ("dream_d2f", "llada2_dmax", "sdar_moe_multi_bd", "fast_dllm_v2", "diffusion_gemma", "llada_lora")


def device_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def assert_within_share(build, prompts: list[list[int]], params: SamplingParams) -> Diffulex:
    """Build an engine with `build(utilization)` at ROOM bytes beyond what the device holds now, generate `prompts`,
    and hold it to the share: once built, at its peak and after generating, with a pool of more than half of ROOM."""
    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(device)[1]
    utilization = (device_used(device) + ROOM) / total
    torch.cuda.reset_peak_memory_stats(device)
    llm = build(utilization)
    allowed = utilization * total

    def peak() -> int:  # the allocator's highest reservation, with what the process holds outside it now
        return torch.cuda.max_memory_reserved(device) + device_used(device) - torch.cuda.memory_reserved(device)

    built = peak()
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [params.max_tokens] * len(prompts)
    # The pool is the share's: sized to the last page, not merely below it.
    page = llm.runner.kv_cache.nbytes / llm.kv_cache.num_pages
    assert llm.runner.kv_cache.nbytes > ROOM / 2
    over = {"once built": built - allowed, "at the peak": peak() - allowed,
            "after generating": device_used(device) - allowed}
    assert all(bytes_over <= 0 for bytes_over in over.values()), (
        f"past gpu_memory_utilization's {allowed / 1e9:.3f} GB by, in pages of {page / 1e6:.1f} MB: "
        + ", ".join(f"{when} {bytes_over / page:.1f}" for when, bytes_over in over.items()))
    return llm


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_engine_holds_no_more_than_gpu_memory_utilization_allows_at_its_peak(tmp_path, kv_cache_dtype):
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 K/V rows need compute capability 8.9 or newer")
    # Head size 64 and a vocabulary wide enough that a step's logits outweigh its tiny forward.
    checkpoint = write_random_checkpoint(tmp_path / "llada", "llada", hidden_size=256, num_heads=4, num_kv_heads=4,
                                         head_dim=64, intermediate_size=512, vocab_size=32768,
                                         max_position_embeddings=1024)
    prompts = [[(37 * i + n) % 30000 + 1 for i in range(100 + 40 * n)] for n in range(16)]
    assert_within_share(
        lambda utilization: Diffulex(str(checkpoint), device="cuda", dtype="bfloat16",
                                     gpu_memory_utilization=utilization, block_size=32, max_num_reqs=16,
                                     max_model_len=1024, kv_cache_dtype=kv_cache_dtype),
        prompts, SamplingParams(max_tokens=96, ignore_eos=True, seed=1))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_sizes_its_pool_within_gpu_memory_utilization(tmp_path, name):
    family, _, request = MODELS[name]
    checkpoint = write_checkpoint(tmp_path / family, family)
    adapter = write_adapter(tmp_path / "adapter", checkpoint) if "lora_modules" in MODELS[name][1] else None
    settings = model_settings(name, adapter)
    # Within the byte vocabulary: 8 prompts of 60 to 340 tokens.
    prompts = [[(37 * i + n) % 250 + 3 for i in range(60 + 40 * n)] for n in range(8)]
    llm = assert_within_share(
        lambda utilization: Diffulex(str(checkpoint), device="cuda", dtype="bfloat16",
                                     gpu_memory_utilization=utilization, max_num_reqs=8, max_model_len=512,
                                     **settings),
        prompts, SamplingParams(max_tokens=24, ignore_eos=True, seed=1, **request))
    assert isinstance(llm.runner.padded_forward, CUDAGraphForward), (
        f"{name}'s forward replays no CUDA graph, so its capture was not sized")
