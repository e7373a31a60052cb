"""How a rank builds what it holds: the device and dtype a setting names, the model (its share of it) with its
adapters and attention backend, the number of KV pages it has room for, and its runner. The engine (rank 0) and
the tensor-parallel workers build theirs through these same functions (`load_rank_model`, then `build_runner`),
so every rank agrees on them."""
from __future__ import annotations

import logging
import os

import torch

from .attention import paged_attention_reference
from .config import Config
from .cuda_graph import CUDAGraphForward
from .flash_attention import FlashAttention, refusal as flash_refusal
from .loader import check_fp8_device, load_model
from .lora import attach_adapters, load_adapter, merge_adapter
from .quantization import has_fp8, quantize_model
from .registry import STRATEGIES
from .runner import kv_cache_layout, profile_peak_memory
from .tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """The device a setting names. A GPU always carries its index (`cuda:N`): every thread starts on GPU 0, so a
    bare `cuda` would mean the GPU of whichever thread reads it, and `torch.cuda.set_device` refuses it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"config field 'device' is {name!r}, but no CUDA device is available")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"config field 'device' is {name!r}, but this machine has {torch.cuda.device_count()} "
                         f"CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_attention(name: str, device: torch.device, head_dims: tuple[int, ...],
                      kernel_head_dims: tuple[int, ...] = (64, 128), dtype: torch.dtype = torch.bfloat16):
    """The attention function for `attention_backend`: "auto" takes the Triton kernels on a GPU when they serve
    every head size of the model's layers (`head_dims`): those its family's Triton path is built for
    (`kernel_head_dims`), and the engine's dtype (float64, a reference dtype, is torch's only); else the torch
    reference."""
    if name == "torch" or (name == "auto" and (device.type != "cuda" or dtype == torch.float64)):
        return paged_attention_reference
    if device.type != "cuda":
        raise ValueError("config field 'attention_backend' is 'triton', which needs a CUDA device; use 'torch' on CPU")
    if dtype == torch.float64:
        raise ValueError("config field 'attention_backend' is 'triton', whose kernels take float32, bfloat16 and "
                         "float16; dtype 'float64' runs on 'torch' or 'auto'")
    from diffulex_kernels.attention import paged_attention

    if set(head_dims) <= set(kernel_head_dims):
        return paged_attention
    if name == "auto":
        return paged_attention_reference
    shown = head_dims[0] if len(head_dims) == 1 else head_dims
    raise ValueError(f"config field 'attention_backend' is 'triton', whose kernels take head_dim {kernel_head_dims}; "
                     f"this model's is {shown}: use 'torch' or 'auto'")


def load_model_with_adapters(config: Config, device: torch.device, dtype: torch.dtype,
                             tp: TensorParallel = TensorParallel()):
    """The checkpoint's model (this rank's share of it) with its adapters merged or attached. Returns (model,
    lora_slots): lora_name -> the adapter's slot in the stacks."""
    # A merged adapter goes into the float weights, before they are quantized.
    merge_first = config.lora_path is not None
    model = load_model(config.model, model_name=config.model_name, dtype=dtype, device=device, tp=tp,
                       quantization=None if merge_first else config.quantization,
                       fp8_lm_head=config.fp8_lm_head and not merge_first)
    if merge_first:
        if has_fp8(model):
            raise ValueError(f"config field 'lora_path' merges an adapter into the weights, but {config.model} is an "
                             "FP8 checkpoint; use lora_modules, whose adapters are applied beside the weights")
        merge_adapter(model, load_adapter(config.lora_path, model, "lora_path", config.max_lora_rank))
        if config.quantization is not None:
            quantize_model(model, lm_head=config.fp8_lm_head)
    adapters = [load_adapter(path, model, name, config.max_lora_rank)
                for name, path in config.lora_module_paths.items()]
    attach_adapters(model, adapters)
    return model, {adapter.name: slot for slot, adapter in enumerate(adapters)}


def select_attention(model, attention_backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Every layer's attention function for `attention_backend`. "flash_attn" takes flash-attn for prompts and for
    the cached context of wide GQA groups, and the Triton kernel for the rest (flash_attention.py), or refuses the
    model by name; "auto" takes it too where the model's Triton path is taken and nothing refuses it."""
    head_dims = tuple(sorted({layer.attn.head_dim for layer in model.layers}))
    windowed = any(layer.attn.window is not None for layer in model.layers)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    wants_flash = attention_backend in ("flash_attn", "auto")
    why_not_flash = flash_refusal(capability, dtype, head_dims, windowed) if wants_flash else "not asked for"
    if attention_backend == "flash_attn" and why_not_flash is not None:
        raise ValueError(f"config field 'attention_backend' is 'flash_attn', {why_not_flash}")
    blocks_backend = "triton" if attention_backend == "flash_attn" else attention_backend
    attention_fn = resolve_attention(blocks_backend, device, head_dims, model.KERNEL_HEAD_DIMS, dtype)
    if why_not_flash is None and attention_fn is not paged_attention_reference:
        attention_fn = FlashAttention(attention_fn)
    for layer in model.layers:
        layer.attn.attention_fn = attention_fn
    # Where the family has one, the Triton attention comes with the rest of its Triton path (fused norms, RoPE,
    # sampler, graphs).
    model.fused_kernels = model.FUSED_FORWARD and attention_fn is not paged_attention_reference


def attention_backend_name(model) -> str:
    """The backend a loaded model's attention resolved to: torch, triton or flash_attn."""
    attention_fn = model.layers[0].attn.attention_fn
    if attention_fn in (None, paged_attention_reference):
        return "torch"
    return "flash_attn" if isinstance(attention_fn, FlashAttention) else "triton"


def num_kv_pages(config: Config, model, device: torch.device, dtype: torch.dtype, runner_cls) -> int:
    """KV pages of page_size tokens: config.num_kv_pages, else as many as max_num_reqs requests of max_model_len
    take on the CPU, else what gpu_memory_utilization leaves on the GPU."""
    per_request = -(-config.max_model_len // config.page_size)
    shape, cache_dtype = kv_cache_layout(model, 1, config.page_size, dtype, config.kv_cache_dtype)
    page_bytes = torch.empty(shape, dtype=cache_dtype).nbytes
    if config.num_kv_pages is not None:  # a pool smaller than one max_model_len sequence refuses longer requests
        return _fits_memory(config.num_kv_pages, page_bytes, device,
                            f"config field 'num_kv_pages' ({config.num_kv_pages})")
    if device.type != "cuda":
        return _fits_memory(config.max_num_reqs * per_request, page_bytes, device,
                            f"config fields 'max_num_reqs' ({config.max_num_reqs}) and 'max_model_len' "
                            f"({config.max_model_len}) size the KV cache where 'num_kv_pages' is unset")
    # Whatever gpu_memory_utilization leaves after the weights and what the steps reserve, measured by running the
    # largest step: its forward, its logits and the sampler (runner_cls's), and where CUDA graphs replay the forward,
    # the capture of the largest graph over a one-page cache of its own. Reservations, not allocations, because the
    # caching allocator keeps each block, rounded, for its stream or its pool. The eager steps reserve theirs; a
    # capture's eager run reserves its activations on the capture stream, and the capture keeps the graphs' pool,
    # which no eager step can take. The count is the eager steps' reservation, plus the capture's peak (its eager
    # run, or the pool it fills, whichever is larger), plus the pool: serving peaks at the pool with the eager
    # blocks or a capture's eager run (a capture releases the eager blocks before its eager run), and the sum's
    # margin holds what the steps of many shapes that serving meets cache beyond the one profiled step. Each part
    # is read against the reservation before the profile, so the blocks the profile leaves allocated (the default
    # stream's cuBLAS workspace) count in each. The runner's sampler and attention kernels are loaded before this
    # (build_runner), so the free memory counts their modules.
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    forward_bytes, sampler_bytes = profile_peak_memory(model, config, device, runner_cls)
    step_bytes = eager_bytes = torch.cuda.memory_reserved(device) - reserved
    if model.replays_graphs() and not config.enforce_eager:
        torch.cuda.empty_cache()  # as a capture does first: the peak from here is the capture's with what stays
        torch.cuda.reset_peak_memory_stats(device)
        graphs = CUDAGraphForward(model, torch.zeros(shape, dtype=cache_dtype, device=device), config, device,
                                  runner_cls.token_merge_for(config))
        graphs.capture_largest()
        torch.cuda.synchronize(device)
        capture_bytes = torch.cuda.max_memory_reserved(device) - reserved - page_bytes
        pool_bytes = torch.cuda.memory_reserved(device) - reserved - page_bytes
        step_bytes = eager_bytes + capture_bytes + pool_bytes
        del graphs  # its pool and cache go back to the device; its capture stream's cuBLAS workspace stays
        logger.info("a capture reserves %.3f GB at its peak, and the CUDA graphs keep %.3f GB", capture_bytes / 1e9,
                    pool_bytes / 1e9)
    torch.cuda.empty_cache()
    logger.info("the largest step reserves %.3f GB (its forward and sampler allocate %.3f and %.3f GB at their "
                "peaks); %.3f GB are kept for steps", eager_bytes / 1e9, forward_bytes / 1e9, sampler_bytes / 1e9,
                step_bytes / 1e9)
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - config.gpu_memory_utilization) * total - step_bytes
    if budget < page_bytes * per_request:
        raise ValueError(f"config field 'gpu_memory_utilization' ({config.gpu_memory_utilization}) leaves no room "
                         f"for one max_model_len sequence of KV cache after the weights")
    return int(budget // page_bytes)


def _fits_memory(pages: int, page_bytes: int, device: torch.device, setting: str) -> int:
    """`pages`, refused by the `setting` that asks for them where their cache is larger than the device's memory
    (the GPU's free memory now; the CPU's physical memory), before anything is allocated."""
    if device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0]
    else:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pages * page_bytes > room:
        raise ValueError(f"{setting}: {pages} KV pages of {page_bytes} bytes ({pages * page_bytes / 2**30:.3g} GiB) "
                         f"do not fit the {room / 2**30:.3g} GiB {'free on' if device.type == 'cuda' else 'of'} "
                         f"{device}")
    return pages


def load_rank_model(config: Config, device: torch.device, dtype: torch.dtype, tp: TensorParallel):
    """This rank's share of the model, with its adapters and attention backend. Returns (model, lora_slots)."""
    if config.kv_cache_dtype == "fp8" and device.type == "cuda":  # before the weights take the GPU's time
        check_fp8_device(device, "config field 'kv_cache_dtype' 'fp8'", "to convert K/V rows to FP8")
    model, lora_slots = load_model_with_adapters(config, device, dtype, tp)
    if config.kv_cache_dtype == "fp8" and hasattr(model, "kv_cache_shape"):
        raise ValueError(f"config field 'kv_cache_dtype' is 'fp8', but {type(model).__name__}'s cache is laid out "
                         f"per layer and holds the model's dtype only; leave kv_cache_dtype 'auto'")
    select_attention(model, config.attention_backend, device, dtype)
    return model, lora_slots


def build_runner(config: Config, model, device: torch.device, dtype: torch.dtype, channel=None):
    """This rank's runner for the resolved `config`, over the KV pages every rank has room for (the fewest any
    rank reports over `channel`, under tensor parallelism). Returns (runner, num_pages)."""
    strategy = STRATEGIES.get(config.decoding_strategy)
    # Before the sizing, whose free memory then counts the loaded modules; once, as no kernel needs it again.
    strategy.runner_cls.compile_kernels(config, model, device, dtype)
    pages = num_kv_pages(config, model, device, dtype, strategy.runner_cls)
    if channel is not None:  # every rank's cache holds the same pages
        pages = channel.minimum(pages)
    acceptance = strategy.acceptance_cls(config.mode, config.mask_token_id)
    return strategy.runner_cls(config, model, pages, acceptance, device, dtype), pages
