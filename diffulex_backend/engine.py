"""DiffulexEngine: requests in, committed tokens out, one scheduler step at a time."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from dataclasses import dataclass

from . import strategies  # noqa: F401  (registers every strategy)
from .config import Config
from .kv_cache import KVCacheManager
from .model_setup import attention_backend_name, build_runner, load_rank_model, resolve_device, resolve_dtype
from .output import Detokenizer, RequestDelta, RequestOutput, StepOutput
from .plan import SchedulerOutput
from .profiling import StepProfiler, step_range
from .refusal import Refusal
from .resolve import ResolvedRequest, resolve
from .registry import STRATEGIES
from .request import FinishReason, Request
from .sampling import SamplingParams
from .tensor_parallel import TensorParallel
from .workers import BroadcastRunner, WorkerGroup
from .tokenizer import load_tokenizer, longest_token_chars, resolve_eos_token_ids, resolve_mask_token_id
from .warm_up import warm_up as run_warm_up


@dataclass
class EngineMetrics:
    num_running: int
    num_waiting: int
    num_preempted: int  # waiting requests that were preempted and await recompute
    num_preemptions: int  # since start
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_free: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_forward_passes: int
    num_forward_tokens: int
    model_flops: float


class DiffulexEngine:
    def __init__(self, model: str, *, warm_up: bool = True, **kwargs):
        """`kwargs` are Config's fields. With `warm_up` (the default) the engine decodes a few requests before it
        returns, so that kernel compiles and CUDA graph captures happen now rather than in the first generate
        (warm_up.py); `warm_up_report` says how long that took."""
        # The settings as given, until the checkpoint is read; then a resolved copy with nothing left unset.
        self.config = config = Config(model=model, **kwargs)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.profiler = StepProfiler(config.profile_dir, self.device)
        # Under tensor parallelism the other ranks start first, so they load their shares while this one does.
        self.workers = WorkerGroup(config, self.device) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config)
            self.warm_up_report = run_warm_up(self) if warm_up else None
        except BaseException:
            self.close()
            raise

    def _build(self, config: Config) -> None:
        tp = TensorParallel() if self.workers is None else self.workers.tp
        self.model, self.lora_slots = self._on_ranks(self._load_model, tp)
        arch = self.model.arch
        max_model_len = arch.max_position_embeddings if config.max_model_len is None else config.max_model_len
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(f"config field 'max_model_len' must be <= the model's max_position_embeddings "
                             f"({arch.max_position_embeddings}), got {max_model_len}")
        self.tokenizer = load_tokenizer(config.model)
        mask_token_id = config.mask_token_id
        if mask_token_id is None:
            mask_token_id = resolve_mask_token_id(arch, self.tokenizer)
        if mask_token_id >= arch.vocab_size:
            raise ValueError(f"config field 'mask_token_id' must be < vocab_size ({arch.vocab_size}), "
                             f"got {mask_token_id}")
        self.config = config = dataclasses.replace(config, model_name=arch.model_name, max_model_len=max_model_len,
                                                   mask_token_id=mask_token_id)
        self.eos_token_ids = list(resolve_eos_token_ids(arch, self.tokenizer))
        if mask_token_id in self.eos_token_ids:  # never predicted (runner.py), so no request could ever stop
            raise ValueError(f"config field 'mask_token_id' is {mask_token_id}, an end-of-sequence token of this "
                             f"model (eos ids {self.eos_token_ids}); the mask token must be one the model never "
                             "outputs")
        if config.token_merge_top_k > arch.vocab_size:
            raise ValueError(f"config field 'token_merge_top_k' must be <= vocab_size ({arch.vocab_size}), "
                             f"got {config.token_merge_top_k}")
        self.max_token_chars = longest_token_chars(self.tokenizer)

        strategy = STRATEGIES.get(config.decoding_strategy)
        only = getattr(self.model, "DECODING_STRATEGIES", None)  # a family that decodes with its own strategy
        if only is not None and strategy.name not in only:
            raise ValueError(f"model {arch.model_name!r} decodes with decoding_strategy {' or '.join(map(repr, only))}"
                             f" only, got {strategy.name!r}; setting model_name {arch.model_name!r} makes it the "
                             "default")
        self.req_cls: type[Request] = strategy.request_cls
        channel = None if self.workers is None else self.workers.channel
        if channel is not None:
            self._on_ranks(channel.broadcast, config)
        self.runner, pages = self._on_ranks(build_runner, config, self.model, self.device, self.dtype, channel)
        self.kv_cache: KVCacheManager = strategy.kv_cache_cls(pages, config.page_size, config.enable_prefix_caching)
        if self.workers is not None:
            self.runner = BroadcastRunner(self.runner, self.workers)
            self.workers.in_step = True  # every rank built its runner and waits for the first plan
        self.scheduler = strategy.scheduler_cls(config, self.kv_cache)

        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, Detokenizer] = {}
        self.last_schedule = SchedulerOutput()
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self.num_forward_passes = 0
        self.num_forward_tokens = 0
        self.model_flops = 0.0

    def resolved_settings(self) -> dict[str, str]:
        """Every setting as the engine resolved it, as text: Config's fields with nothing left "auto" or unset that
        the engine decides (device, dtype, strategy, max_model_len, mask token), and what it sized from them."""
        config = self.config
        settings = {name: "" if getattr(config, name) is None else str(getattr(config, name))
                    for name in Config.field_names()}
        settings.update(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                        num_kv_pages=str(self.kv_cache.num_pages), attention_backend=attention_backend_name(self.model))
        return settings

    def _load_model(self, tp: TensorParallel):
        return load_rank_model(self.config, self.device, self.dtype, tp)

    def _on_ranks(self, fn, *args):
        """fn(*args), a step every rank takes together: a failure there may be another rank's, and is reported
        as that rank's."""
        return fn(*args) if self.workers is None else self.workers.call(fn, *args)

    def close(self) -> None:
        """Write a step recording under way (profile_steps), and stop the other ranks' processes (tensor
        parallelism). The engine serves no step after this."""
        self.profiler.close()
        if self.workers is not None:
            self.workers.close()

    # ---- requests -----------------------------------------------------------------------------------------
    def prepare_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> ResolvedRequest:
        """Tokenize and check a request without touching engine state, so any thread may call it and a request
        that cannot be served is refused here, alone, before it could reach a step. Raises ValueError."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab, mask, limit = self.model.arch.vocab_size, self.config.mask_token_id, self.config.max_model_len
        if isinstance(prompt, str):
            # Every token covers at most max_token_chars characters, so a longer text cannot fit: it is refused
            # before the tokenizer spends seconds on it.
            if len(prompt) > limit * self.max_token_chars:
                raise Refusal(f"prompt has {len(prompt)} characters; at most {limit * self.max_token_chars} "
                              f"can fit max_model_len ({limit}) tokens", "prompt")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise Refusal(f"prompt token id {bad[0]} is out of range [0, {vocab})", "input_ids")
        if not prompt_ids:
            raise Refusal("prompt is empty", "prompt")
        if mask in prompt_ids:
            raise Refusal(f"prompt holds the mask token ({mask}) at position {prompt_ids.index(mask)}; "
                          "the engine decodes masked positions only in the generation area", "prompt")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise Refusal(f"sampling parameter 'stop_token_ids' holds {bad[0]}, outside the vocabulary [0, {vocab})",
                          "stop_token_ids")
        n, m = len(prompt_ids), params.max_tokens
        if n + m > limit:
            raise Refusal(f"prompt has {n} tokens and max_tokens is {m}: {n} + {m} = {n + m} exceeds "
                          f"max_model_len ({limit})", "max_tokens")
        self.req_cls.check_prompt(n, self.config)
        if params.lora_name is not None and params.lora_name not in self.lora_slots:
            raise Refusal(f"sampling parameter 'lora_name' is {params.lora_name!r}, which names no adapter; "
                          f"registered (config field 'lora_modules'): {sorted(self.lora_slots)}", "lora_name")
        if params.profile_steps is not None and self.config.profile_dir is None:
            raise Refusal(f"sampling parameter 'profile_steps' is {params.profile_steps}, but config field "
                          "'profile_dir' is not set: this engine records no traces", "profile_steps")
        if not self.kv_cache.holds(n + m):
            raise Refusal(f"request needs up to {self.kv_cache.pages_for(n + m)} KV pages but the cache has "
                          f"{self.kv_cache.num_pages}", "max_tokens")
        return resolve(prompt_ids, params, self.config, self.req_cls, draw_seed=lambda: self._seeds.getrandbits(32),
                       lora_index=-1 if params.lora_name is None else self.lora_slots[params.lora_name],
                       eos_token_ids=self.eos_token_ids, vocab_size=vocab)

    def add_request(self, prompt: str | list[int] | ResolvedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. A ResolvedRequest (from prepare_request) is queued as it is."""
        resolved = prompt if isinstance(prompt, ResolvedRequest) else self.prepare_request(prompt, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.req_cls(request_id, resolved, self.config, self.config.mask_token_id, self.model.arch.shifted)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if resolved.params.profile_steps is not None:
            self.profiler.request(resolved.params.profile_steps, request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop the request and free its pages now. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req, FinishReason.ABORT)
        self.detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step: each request's newly committed tokens with their text, made on this thread (the offline API).
        A stop string that matches ends its request within this step."""
        with self._profiled():
            return [self._output(delta) for delta in self._step()]

    def step_deltas(self) -> list[RequestDelta]:
        """One step: each request's newly committed token ids, for a caller that makes the text on another thread
        (the served model's response thread), so that detokenizing never holds up the device. Such a caller ends a
        request on a stop string with abort(): the request runs on until the abort reaches the engine between two
        steps, one step more when that caller keeps up."""
        with self._profiled():
            deltas = self._step()
            for delta in deltas:
                if delta.finish_reason is not None:
                    del self.requests[delta.request_id]
            return deltas

    @contextlib.contextmanager
    def _profiled(self):
        """A step, recorded when a request asked for it (profile_steps)."""
        self.profiler.before_step()
        try:
            yield
        finally:
            self.profiler.after_step(engine_idle=not self.requests)

    def _step(self) -> list[RequestDelta]:
        with step_range("schedule", self.device):
            sched = self.last_schedule = self.scheduler.schedule()
        if not sched.plans:
            return []
        result = self.runner.execute(sched)
        self.num_forward_passes += 1
        self.num_forward_tokens += result.num_tokens
        self.model_flops += result.flops
        return self.scheduler.update_from_output(sched, result)

    def _output(self, delta: RequestDelta) -> StepOutput:
        """The delta with its text. A stop string that matches in the text ends the request at fewer tokens."""
        req = self.requests[delta.request_id]
        detokenizer = self.detokenizers.get(delta.request_id)
        if detokenizer is None:
            detokenizer = self.detokenizers[delta.request_id] = Detokenizer(self.tokenizer, list(req.stop.strings),
                                                                            req.stop.min_tokens)
        text, keep = detokenizer.add(delta.token_ids, final=delta.finish_reason is not None)
        if keep is not None:
            delta = self.scheduler.stop_at(req, delta, keep)
        if delta.finish_reason is not None:
            del self.requests[delta.request_id]
            self.detokenizers.pop(delta.request_id)
        return StepOutput.of(delta, text)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        reqs = []
        for prompt, p in zip(prompts, params_list):
            reqs.append(self.requests[self.add_request(prompt, p)])
        outs = {r.request_id: RequestOutput(r.request_id, r.tokens[: r.num_prompt_tokens].tolist(),
                                            arrival_time=r.arrival_time) for r in reqs}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        while any(not r.is_finished for r in reqs):
            deltas = self.step()
            if not self.last_schedule.plans:
                raise RuntimeError("no request could be scheduled: the KV cache or token budget is too small")
            for delta in deltas:
                outs[delta.request_id].add(delta)
                if delta.finished and bar is not None:
                    bar.update(1)
        for r in reqs:
            out = outs[r.request_id]
            out.finish_reason, out.nfe = r.finish_reason, r.nfe
            out.first_token_time, out.finish_time = r.first_token_time, r.finish_time
        if bar is not None:
            bar.close()
        return [outs[r.request_id] for r in reqs]

    def metrics(self) -> EngineMetrics:
        kv = self.kv_cache
        return EngineMetrics(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preempted=sum(1 for r in self.scheduler.waiting if r.nfe > 0),
            num_preemptions=self.scheduler.num_preemptions,
            kv_pages_total=kv.num_pages, kv_pages_used=kv.num_used_pages, kv_pages_free=kv.num_free_pages,
            prefix_cache_queried_tokens=kv.prefix_queried_tokens, prefix_cache_hit_tokens=kv.prefix_hit_tokens,
            num_forward_passes=self.num_forward_passes, num_forward_tokens=self.num_forward_tokens,
            model_flops=self.model_flops,
        )
