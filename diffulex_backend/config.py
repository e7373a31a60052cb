"""Engine configuration: one frozen, validated dataclass.

`Config(...)` checks every field, then hands the strategy-specific checks to the strategy's record
(registry.py), and fills what the strategy decides: its canonical name for an alias, `sampling_mode` and
`enable_prefix_caching` when unset, and the model family's strategy when `decoding_strategy` is unset. What depends on the checkpoint (`model_name`, `mask_token_id`,
`max_model_len`) stays None until the engine reads the checkpoint and holds a resolved copy
(`dataclasses.replace`, validated again); nothing changes a Config after it is built.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .registry import STRATEGIES, default_strategy
from .sampling import UNREAD_IN_MODE, SamplingMode

# The settings that decide when the next block joins (add_block_threshold) and when a block is complete enough for
# the one after it to decode (semi_complete_threshold): read by every strategy built on BlockDiffusionRequest.
BLOCK_THRESHOLDS = frozenset({"add_block_threshold", "semi_complete_threshold"})
QUANTIZATIONS = ("fp8",)  # the weight quantizations `quantization` names (quantization.py)
KV_CACHE_DTYPES = ("auto", "fp8")  # the model's dtype, or FP8 rows with a scale each (diffulex_kernels.kv_store)


MAX_TENSOR_PARALLEL = 64
# Sizes and counts (tokens, pages, requests, ids): the device tensors that hold them, and the kernels' offsets, are
# int32.
MAX_SIZE = 2**31 - 1
PATHS = ("model", "lora_path", "profile_dir")  # fields that take a path; os.PathLike values become their text
DEVICES_HELP = "'auto', 'cpu', 'cuda' or 'cuda:N'"
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")  # float64: reference checks, torch attention only
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
# dmax_topk: DMax's mixture of the top-k tokens and the mask embedding; iter_smooth_topk: the token's own
# embedding plus the weighted top-k embeddings (Diffulex's second token-merge mode).
TOKEN_MERGE_MODES = ("dmax_topk", "iter_smooth_topk")


@dataclass(frozen=True)
class Config:
    model: str
    model_name: str | None = None  # detected from config.json when None
    # A registered name or alias, the canonical name once built; None: model_name's family's (registry.py's
    # default_strategy: d2f for diffucoder, else multi_bd).
    decoding_strategy: str | None = None
    sampling_mode: str | None = None  # None: the strategy's ("topk" for vanilla, "threshold" otherwise)
    block_size: int = 32
    buffer_size: int = 1  # blocks in flight per request (multi_bd, d2f)
    page_size: int = 32
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_num_batched_tokens: int = 4096
    max_num_reqs: int = 64
    num_kv_pages: int | None = None  # None: sized from gpu_memory_utilization on GPU, from the limits on CPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool | None = None  # None: on where the strategy allows it (multi_bd)
    enforce_eager: bool = False
    # "auto": on a GPU the Triton kernels where they take the model's head sizes, with flash-attn for prompts and
    # wide GQA groups' cached contexts where it is installed and serves the model (flash_attention.py); else torch
    attention_backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"  # "auto": bfloat16 on GPU, float32 on CPU
    accept_threshold: float = 0.9
    remask_threshold: float = 0.0  # 0 never remasks
    add_block_threshold: float = 0.1
    semi_complete_threshold: float = 0.9
    mask_token_id: int | None = None  # from config.json, then the tokenizer, when None
    dual_cache: bool = False  # fast_dllm: also cache the suffix after the current block
    cache_refresh_interval: int = 0  # fast_dllm: recompute the cache every N steps inside a block; 0 = at block starts only
    sub_block_size: int = 8  # fast_dllm_v2: a block is decoded sub-block by sub-block, left to right
    # dmax: soft parallel decoding (strategies/dmax.py). A decoded, uncommitted position is fed as a mixture of
    # its predicted tokens' embeddings and the mask embedding instead of its token's embedding.
    token_merge_mode: str = "dmax_topk"  # or "iter_smooth_topk"
    token_merge_top_k: int = 1  # predicted tokens per position in the mixture
    token_merge_renormalize: bool = True  # rescale the mixture to the probability-weighted norm of its parts
    token_merge_weight: float = 1.0  # 0 feeds the token itself (hard decoding); 1 the mixture
    edit_threshold: float = 0.9  # dmax: 0 leaves decoded tokens final; else they are revised until stable
    # Sparse attention by page retention (retention.py): the share of a prompt's KV pages a request keeps once its
    # first block has seen them; 1 keeps all (dense attention).
    retention_ratio: float = 1.0
    head_select: bool = True  # pages ranked by how many heads choose them, rather than by mean attention
    tensor_parallel_size: int = 1  # ranks the model is split over (workers.py): processes, one GPU each
    expert_parallel: bool = False  # MoE models under tensor parallelism: whole experts per rank
    seed: int = 0  # noise seed of requests that bring none
    lora_path: str | None = None  # a PEFT LoRA directory merged into the weights at load (needs pre_merge_lora)
    pre_merge_lora: bool = False
    # Adapters a request picks by its lora_name: "name=path,name=path" (config.pbtxt), or {name: path} in Python.
    lora_modules: str | None = None
    max_loras: int = 8  # the most adapters lora_modules may register; all of them stay loaded
    max_lora_rank: int = 64  # adapters of a higher rank are refused at load
    # "fp8": a float checkpoint's linear projections and MoE experts are quantized to float8_e4m3fn at load, with a
    # scale per output channel (quantization.py); None: the checkpoint's own (an FP8 checkpoint loads as FP8).
    quantization: str | None = None
    fp8_lm_head: bool = False  # with quantization "fp8", the output head too (it stays in the model dtype otherwise)
    # "fp8": the KV cache holds float8_e4m3fn rows, each (token, head) with its own scale: about half the bytes of a
    # bf16 page, so twice the pages in the same memory. "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    # Where a request's profile_steps records its trace of the next steps (profiling.py); None refuses profile_steps,
    # so that no client can fill a disk it was not given.
    profile_dir: str | None = None

    def __post_init__(self):
        for name in PATHS:  # one form from here on: the text config.pbtxt gives
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if isinstance(self.lora_modules, Mapping):  # one form from here on: the text config.pbtxt gives
            object.__setattr__(self, "lora_modules", _module_text(self.lora_modules))
        if self.decoding_strategy is None:  # a model_name of the wrong type is refused below, by name
            family = self.model_name if isinstance(self.model_name, str) else None
            object.__setattr__(self, "decoding_strategy", default_strategy(family))
        self._validate_fields()
        strategy = STRATEGIES.get(self.decoding_strategy)
        # Filled in once, while the dataclass is being built: afterwards it is frozen.
        object.__setattr__(self, "decoding_strategy", strategy.name)
        if self.sampling_mode is None:
            object.__setattr__(self, "sampling_mode", strategy.default_sampling_mode.value)
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", strategy.supports_prefix_caching)
        self._refuse_other_strategies_options(strategy)
        self._refuse_thresholds_past_one_block(strategy)
        strategy.validate(self)
        self._refuse_settings_never_read(strategy)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @property
    def mode(self) -> SamplingMode:
        return SamplingMode(self.sampling_mode)

    @property
    def lora_module_paths(self) -> dict[str, str]:
        """lora_modules as {name: path}, in the order given."""
        modules: dict[str, str] = {}
        if self.lora_modules is None:
            return modules
        for item in self.lora_modules.split(","):
            name, sep, path = (part.strip() for part in item.partition("="))
            if not sep or not name or not path:
                raise ValueError(f"config field 'lora_modules' must be name=path pairs separated by commas, "
                                 f"got {item.strip()!r}")
            if name in modules:
                raise ValueError(f"config field 'lora_modules' names adapter {name!r} twice")
            modules[name] = path
        return modules

    def _validate_fields(self):
        """The checks that hold whatever the strategy."""
        def fail(name, allowed):
            raise ValueError(f"config field '{name}' must be {allowed}, got {getattr(self, name)!r}")

        def check_int(name, low, high=MAX_SIZE):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool) or value < low
                    or (high is not None and value > high)):
                fail(name, f"an integer >= {low}" + (f" and <= {high}" if high is not None else ""))

        def check_fraction(name):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                fail(name, "a number in [0, 1]")

        def check_bool(name, optional=False):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (optional and value is None)):
                fail(name, "true or false")

        if not isinstance(self.model, str) or not self.model:
            fail("model", "a path to a checkpoint directory")
        if not isinstance(self.decoding_strategy, str) or self.decoding_strategy not in STRATEGIES:
            fail("decoding_strategy", f"one of {STRATEGIES.keys()}")
        if self.sampling_mode is not None and self.sampling_mode not in [m.value for m in SamplingMode]:
            fail("sampling_mode", f"one of {[m.value for m in SamplingMode]}")
        for name, low in (("block_size", 1), ("buffer_size", 1), ("page_size", 1), ("max_num_batched_tokens", 1),
                          ("max_num_reqs", 1), ("cache_refresh_interval", 0), ("tensor_parallel_size", 1),
                          ("sub_block_size", 1), ("token_merge_top_k", 1)):
            check_int(name, low)
        check_int("seed", 0, high=None)  # any size: the noise key hashes it
        for name, low in (("max_model_len", 2), ("num_kv_pages", 1), ("mask_token_id", 0)):
            if getattr(self, name) is not None:
                check_int(name, low)
        for name in ("accept_threshold", "remask_threshold", "add_block_threshold", "semi_complete_threshold",
                     "token_merge_weight", "edit_threshold"):
            check_fraction(name)
        value = self.gpu_memory_utilization
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
            fail("gpu_memory_utilization", "a number in (0, 1]")
        check_bool("enforce_eager")
        check_bool("dual_cache")
        check_bool("token_merge_renormalize")
        if self.token_merge_mode not in TOKEN_MERGE_MODES:
            fail("token_merge_mode", f"one of {list(TOKEN_MERGE_MODES)}")
        check_bool("enable_prefix_caching", optional=True)
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail("attention_backend", f"one of {list(ATTENTION_BACKENDS)}")
        if self.dtype not in DTYPES:
            fail("dtype", f"one of {list(DTYPES)}")
        if not _valid_device(self.device):
            fail("device", DEVICES_HELP)
        if self.tensor_parallel_size > MAX_TENSOR_PARALLEL:
            fail("tensor_parallel_size", f"at most {MAX_TENSOR_PARALLEL} (one process per rank)")
        value = self.retention_ratio
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
            fail("retention_ratio", "a number in (0, 1]")
        check_bool("head_select")
        if value < 1 and not STRATEGIES.get(self.decoding_strategy).request_cls.SUPPORTS_PAGE_RETENTION:
            fail("retention_ratio", f"1 for decoding_strategy {self.decoding_strategy!r}, which does not drop pages "
                                    f"(page retention needs {page_retention_strategies()})")
        check_bool("expert_parallel")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            fail("expert_parallel", "false unless tensor_parallel_size is above 1 (it splits experts over ranks)")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            fail("model_name", "a registered model name or null")
        self._validate_lora()
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            fail("quantization", f"one of {[None, *QUANTIZATIONS]} (null: the checkpoint's own weights)")
        check_bool("fp8_lm_head")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", f"one of {list(KV_CACHE_DTYPES)}")
        if self.fp8_lm_head and self.quantization != "fp8":
            fail("fp8_lm_head", "false unless quantization is 'fp8' (it quantizes the output head with the rest)")
        if self.profile_dir is not None and (not isinstance(self.profile_dir, (str, os.PathLike))
                                             or not os.path.isdir(self.profile_dir)
                                             or not os.access(self.profile_dir, os.W_OK | os.X_OK)):
            fail("profile_dir", "a writable directory or null")

    def _refuse_other_strategies_options(self, strategy) -> None:
        """A setting that only other strategies read keeps its default here, or is refused by name."""
        readers: dict[str, list[str]] = {}
        for other in STRATEGIES.values():
            for name in other.options:
                readers.setdefault(name, []).append(other.name)
        for name in sorted(set(readers) - strategy.options):
            if getattr(self, name) != DEFAULTS[name]:
                names = " and ".join(f"'{reader}'" for reader in sorted(readers[name]))
                raise ValueError(f"config field '{name}' applies to decoding_strategy {names} only, not "
                                 f"'{strategy.name}'; leave it at its default ({DEFAULTS[name]!r})")

    def _refuse_thresholds_past_one_block(self, strategy) -> None:
        """Where a request predicts one block a step, the thresholds that act on the blocks after the first keep
        their defaults, or are refused by name."""
        why = strategy.request_cls.one_block_in_flight(self)
        if why is None:
            return
        for name in ("remask_threshold", *sorted(BLOCK_THRESHOLDS & strategy.options)):
            if getattr(self, name) != DEFAULTS[name]:
                raise ValueError(f"config field '{name}' must be {DEFAULTS[name]!r} for decoding_strategy "
                                 f"'{strategy.name}'{why}: it acts on the blocks after the first in flight, and a "
                                 "request predicts one block a step")

    def _refuse_settings_never_read(self, strategy) -> None:
        """The setting of the parameter the sampling mode never reads (accept_threshold under top-k), and head_select
        under a strategy that keeps every page, keep their defaults, or are refused by name."""
        unread, reads = UNREAD_IN_MODE[self.mode]
        if unread in DEFAULTS and getattr(self, unread) != DEFAULTS[unread]:  # steps is a request's alone
            raise ValueError(f"config field '{unread}' must be {DEFAULTS[unread]!r} with sampling_mode "
                             f"'{self.sampling_mode}' (decoding_strategy '{strategy.name}'): {reads}; got "
                             f"{getattr(self, unread)!r}")
        if not strategy.request_cls.SUPPORTS_PAGE_RETENTION and self.head_select != DEFAULTS["head_select"]:
            raise ValueError(f"config field 'head_select' must be true for decoding_strategy '{strategy.name}', which "
                             f"keeps every page (it ranks the pages that page retention keeps, in "
                             f"{page_retention_strategies()}); got {self.head_select!r}")

    def _validate_lora(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config field '{name}' must be an integer >= 1, got {value!r}")
        if not isinstance(self.pre_merge_lora, bool):
            raise ValueError(f"config field 'pre_merge_lora' must be true or false, got {self.pre_merge_lora!r}")
        if self.lora_path is not None and (not isinstance(self.lora_path, str) or not self.lora_path):
            raise ValueError(f"config field 'lora_path' must be an adapter directory, got {self.lora_path!r}")
        if (self.lora_path is not None) != self.pre_merge_lora:
            raise ValueError("config fields 'lora_path' and 'pre_merge_lora' go together: lora_path is merged into "
                             "the weights at load; adapters chosen per request go in 'lora_modules'")
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, str):
                raise ValueError(f"config field 'lora_modules' must be name=path pairs separated by commas, "
                                 f"got {self.lora_modules!r}")
            count = len(self.lora_module_paths)
            if count > self.max_loras:
                raise ValueError(f"config field 'lora_modules' registers {count} adapters, more than "
                                 f"'max_loras' ({self.max_loras})")


DEFAULTS = MappingProxyType({f.name: f.default for f in dataclasses.fields(Config)})


def _module_text(modules: Mapping) -> str | None:
    """{name: path} as lora_modules' text; a name or path that the text could not hold is refused."""
    for name, path in modules.items():
        if not isinstance(name, str) or not name.strip() or any(c in name for c in ",="):
            raise ValueError(f"config field 'lora_modules' names an adapter {name!r}: a name is a non-empty string "
                             "without ',' or '='")
        if not isinstance(path, (str, os.PathLike)) or not str(path).strip() or "," in str(path):
            raise ValueError(f"config field 'lora_modules' gives adapter {name!r} the path {path!r}: a path is a "
                             "non-empty string without ','")
    return ",".join(f"{name}={os.fspath(path)}" for name, path in modules.items()) or None


def page_retention_strategies() -> list[str]:
    return [name for name in STRATEGIES.keys() if STRATEGIES.get(name).request_cls.SUPPORTS_PAGE_RETENTION]


def _valid_device(device) -> bool:
    if not isinstance(device, str):
        return False
    if device in ("auto", "cpu", "cuda"):
        return True
    return re.fullmatch(r"cuda:(0|[1-9][0-9]*)", device) is not None
