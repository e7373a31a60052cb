"""`diffusion_gemma`: uniform diffusion over a canvas, DiffusionGemma's sampler (transformers'
generation_diffusion_gemma.py: EntropyBoundSampler, LinearTemperatureScheduleLogitsProcessor,
StableAndConfidentStoppingCriteria; Diffulex's sampler/diffusion_gemma.py).

No position is masked. Generation is cut into canvases of `canvas_length` (= block_size) tokens, one in flight per
request. A canvas starts as random tokens; each step feeds it (with the previous step's soft embeddings as the
self-conditioning input) and, with the step's temperature T = t_min + (t_max - t_min) (N - s) / N:
  - samples a token per position from softmax(logits / T), and takes the argmax;
  - keeps the sampled tokens of the lowest-entropy positions whose entropies, less the largest of them, sum to at
    most entropy_bound, and re-noises every other position with a random token;
  - ends the canvas with its argmax once the argmax has repeated for stability_threshold steps with a mean
    entropy under confidence_threshold, or after N = max_denoising_steps steps.
An ended canvas is committed at once (its tokens stream) and fed causally in the next forward to store its K/V,
together with the next canvas: transformers' encoder pass over it, without an extra forward.

Every random draw is a hash of (request seed, position, step in the canvas), so a request decodes the same tokens
whatever it is batched with; a preempted request restarts its canvas from step 0 and replays it exactly. The
settings come from the checkpoint's generation_config.json (models/diffusion_gemma.py `DenoiseSchedule`); a
request's own sampling settings that do not apply (temperature, top_k, thresholds, ...) are refused by name.

On a GPU the forward is the torch modules with the Triton attention kernel, replayed from a CUDA graph when the batch
fits a bucket (cuda_graph.py; the canvas rows and their self-conditioning input are the graph's row inputs, and a
canvas's random start tokens are written over the batch's ids on the device); elsewhere, or with enforce_eager, it
runs eagerly. The sampler is batched over every canvas of the step on the device, with one device-to-host copy at
its end. A canvas with a row whose entropy is not finite (its logits hold NaN) ends its request with an error, as the
other strategies end one whose logits are not finite (scheduler.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..acceptance import AcceptanceRule
from ..config import DEFAULTS, Config
from ..sampling import SamplingMode
from ..kv_cache import KVCacheManager
from ..models.diffusion_gemma import DiffusionGemmaModel
from ..plan import LogitBlock, SchedulerOutput, SeqPlan
from ..profiling import step_range
from ..refusal import Refusal
from ..registry import Strategy, register_strategy
from ..request import Request
from ..runner import ModelRunner, StepResult
from ..sampling import SamplingParams, mix32, row_keys, uniform_noise
from ..scheduler import Scheduler
from ..upload import upload
from .checks import check_batched_tokens

# Keys of the three random draws: the starting canvas, the sample of each step, and the re-noising tokens.
CANVAS_KEY, SAMPLE_KEY, RENOISE_KEY = 0x0C4A7A50, 0, 0x5E701CE5

# Logits the sampler holds at once: 1,024 rows of the released vocabulary (262,144), 512 MiB in bf16 on the kernels,
# whatever the batch. The logits of 32 canvases at once would take 4 GiB in bf16, and the torch sampler's float32
# temporaries several times that: an H100 that holds the released model runs out of memory from 16 canvases a step.
SAMPLER_CHUNK_ELEMENTS = 1 << 28

# Sampling parameters with their defaults: a request may leave them so, never set them.
NOT_HONOURED = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "steps": None, "accept_threshold": None,
                "remask_threshold": None, "confidence": "prob", "sub_block_size": None, "edit_threshold": None,
                "lora_name": None}


def random_tokens(seed: int, key: int, positions: torch.Tensor, step: int | torch.Tensor, vocab_size: int
                  ) -> torch.Tensor:
    """A uniform token per position, a function of (seed, key, position, step) only."""
    steps = step if isinstance(step, torch.Tensor) else torch.full_like(positions, step)
    seeds = seed if isinstance(seed, torch.Tensor) else torch.full_like(positions, seed)
    return mix32(row_keys(seeds ^ key, positions, steps)) % vocab_size


@dataclass
class CanvasPlan(SeqPlan):
    """A SeqPlan with the canvas's denoising state: what the runner needs to finish the step on the device."""

    canvas_step: int = 0  # steps this canvas has taken
    last_argmax: np.ndarray | None = None  # [L] the previous step's argmax canvas (-1 before the first)
    repeats: int = 0  # steps in a row, ending with the last, whose argmax canvas was the same


class RowStatistics(NamedTuple):
    """What the sampler takes from each canvas row's tempered distribution softmax(logits / T)."""

    sampled: torch.Tensor  # [R] int64: its Gumbel-max sample
    argmax: torch.Tensor  # [R] int64
    entropy: torch.Tensor  # [R] float32 (float64 in float64)
    soft: torch.Tensor  # [R, hidden]: its expected scaled embedding, the next step's self-conditioning input


def sampler_kernel_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The fused sampler takes bf16, fp16 and float32 logits on CUDA; float64 stays with the reference."""
    return device.type == "cuda" and dtype != torch.float64


def row_statistics(model: DiffusionGemmaModel, hidden: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                   use_kernel: bool) -> RowStatistics:
    """The statistics of rows of `hidden` [R, hidden], each at its temperature [R] with its noise key [R].

    With `use_kernel` (CUDA) the canvas sampling kernels form the capped, tempered scores in registers from the
    head's raw product, stream each row once for its sample, argmax, entropy and logsumexp, and write the
    distribution over the product: a chunk holds its logits once, in the weights' dtype, and nothing else of their
    size. Otherwise the torch reference. Both draw the same noise (the hash of the row key and the token id), so
    their tokens differ only where scores tie within float rounding."""
    if use_kernel:
        from diffulex_kernels.canvas_sampling import canvas_probs_, canvas_statistics

        logits = model.head_logits(hidden)  # [R, V], not yet capped
        cap, temperatures = model.arch.final_logit_softcapping, temperatures.to(torch.float32)
        sampled, argmax, entropy, logsumexp = canvas_statistics(logits, temperatures, keys, cap)
        probs = canvas_probs_(logits, temperatures, logsumexp, cap)
        return RowStatistics(sampled, argmax, entropy, model.soft_embeddings(probs))
    logits = model.compute_logits(hidden)  # [R, V], soft-capped
    work = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(work).div_(temperatures.to(work)[:, None])
    gumbel = -torch.log(-torch.log(uniform_noise(keys, scaled.shape[-1])))
    log_probs = torch.log_softmax(scaled, dim=-1)
    probs = log_probs.exp()
    # A token of probability 0 (a -inf logit no cap bounds) adds nothing to the entropy, as in the kernel; NaN stays.
    entropy = -torch.where(probs == 0, 0, probs * log_probs).sum(-1)
    return RowStatistics((scaled + gumbel.to(work)).argmax(-1), scaled.argmax(-1), entropy,
                         model.soft_embeddings(probs))


def chunked_row_statistics(model: DiffusionGemmaModel, hidden: torch.Tensor, temperatures: torch.Tensor,
                           keys: torch.Tensor, use_kernel: bool) -> RowStatistics:
    """row_statistics over chunks of rows of SAMPLER_CHUNK_ELEMENTS logits at most: the same values, in bounded
    memory."""
    chunk = max(1, SAMPLER_CHUNK_ELEMENTS // model.arch.vocab_size)
    parts = [row_statistics(model, hidden[i:i + chunk], temperatures[i:i + chunk], keys[i:i + chunk], use_kernel)
             for i in range(0, hidden.shape[0], chunk)]
    return RowStatistics(*(torch.cat(field) if len(parts) > 1 else field[0] for field in zip(*parts)))


@dataclass
class CanvasOutcome:
    """What a step decided per predicted position: its argmax, and whether its canvas ended. It travels in
    StepResult.predictions, which the engine hands to each request's record_predictions."""

    argmax: np.ndarray  # [A] int64
    ended: np.ndarray  # [A] bool


class DiffusionGemmaRequest(Request):
    @classmethod
    def check_strategy_params(cls, params: SamplingParams, config: Config) -> None:
        for name, default in NOT_HONOURED.items():
            if getattr(params, name) != default:
                raise Refusal(f"sampling parameter '{name}' does not apply to decoding_strategy 'diffusion_gemma', "
                              "whose temperatures and acceptance come from the checkpoint's generation_config.json",
                              name)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        size = self.config.block_size
        self.num_canvases = -(-self.params.max_tokens // size)
        # Whole canvases: the model denoises canvas_length tokens at a time; output stops at max_tokens.
        tokens = np.full(self.gen_start + self.num_canvases * size, self.mask_token_id, dtype=np.int64)
        tokens[: self.gen_start] = self.tokens[: self.gen_start]
        self.tokens = tokens
        self._start_canvas()

    @property
    def num_blocks(self) -> int:
        return self.num_canvases

    def block_span(self, k: int) -> tuple[int, int]:
        start = self.gen_start + k * self.config.block_size
        return start, start + self.config.block_size

    def _start_canvas(self) -> None:
        self.canvas_step, self.repeats, self.canvas_ended = 0, 0, False
        self.last_argmax = np.full(self.config.block_size, -1, dtype=np.int64)

    def plan(self, token_budget: int) -> SeqPlan | None:
        start = self.num_cached
        canvas_start, canvas_end = self.block_span(self.num_committed_blocks)
        if canvas_end - start <= token_budget:
            end = canvas_end
        else:  # a chunk of the causal part (prompt, committed canvases) only; never a part of a canvas
            end = min(start + token_budget, self.committed_end)
            if end <= start:
                return None
        positions = np.arange(start, end)
        causal = positions < self.committed_end
        blocks = [LogitBlock(canvas_start, canvas_end, True, True, 0)] if end == canvas_end else []
        plan = self.make_plan(start, end, self.num_cached, cache_index=np.where(causal, positions, -1),
                              block_ids=np.where(causal, positions, canvas_start).astype(np.int32), blocks=blocks)
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(SeqPlan)}
        return CanvasPlan(**fields, canvas_step=self.canvas_step, last_argmax=self.last_argmax.copy(),
                          repeats=self.repeats)

    def after_forward(self, plan: SeqPlan) -> None:
        self.num_cached = max(self.num_cached, min(plan.end, self.committed_end))
        if plan.blocks:
            self.num_predict_steps += 1

    def record_predictions(self, start: int, end: int, outcome: CanvasOutcome, at: int) -> None:
        argmax = outcome.argmax[at:at + end - start]
        self.repeats = self.repeats + 1 if np.array_equal(argmax, self.last_argmax) else 1
        self.last_argmax = argmax.copy()
        self.canvas_ended = bool(outcome.ended[at])

    def commit_ready_blocks(self) -> int:
        if not self.canvas_ended:
            self.canvas_step += 1
            return 0
        self.canvas_ended = False
        before = self.num_committed
        _, end = self.block_span(self.num_committed_blocks)
        self.num_committed_blocks += 1
        self.num_committed = min(end - self.gen_start, self.params.max_tokens)
        self._start_canvas()
        return self.num_committed - before

    def reset_for_recompute(self) -> None:
        # The self-conditioning input of the canvas in flight is gone with the runner's state: the canvas starts
        # over from its first step, whose draws are the same, so it decodes the same tokens again.
        super().reset_for_recompute()
        self._start_canvas()


class DiffusionGemmaRunner(ModelRunner):
    """Feeds each canvas with its self-conditioning input and runs the sampler batched over all canvases."""

    def __init__(self, config: Config, model, num_pages: int, acceptance: AcceptanceRule, device: torch.device,
                 dtype: torch.dtype):
        if not isinstance(model, DiffusionGemmaModel):
            raise ValueError(f"decoding_strategy 'diffusion_gemma' decodes model 'diffusion_gemma' only, not "
                             f"{model.arch.model_name!r}")
        if config.block_size != model.arch.canvas_length:
            raise ValueError(f"config field 'block_size' must equal the checkpoint's canvas_length "
                             f"({model.arch.canvas_length}) for decoding_strategy 'diffusion_gemma', "
                             f"got {config.block_size}")
        super().__init__(config, model, num_pages, acceptance, device, dtype)
        self.schedule = model.arch.schedule
        self.use_sampler_kernel = sampler_kernel_serves(device, dtype)
        # The soft embeddings of each request's last step, [L, hidden] on the device: its next step's
        # self-conditioning input. forget() drops an entry.
        self.soft: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: list[str]) -> None:
        super().forget(request_ids)
        for request_id in request_ids:
            self.soft.pop(request_id, None)

    @staticmethod
    def profile_sampler(model, hidden: torch.Tensor) -> None:
        rows = hidden.shape[0]
        chunked_row_statistics(model, hidden, torch.ones(rows, device=hidden.device),
                               torch.zeros(rows, dtype=torch.int64, device=hidden.device),
                               sampler_kernel_serves(hidden.device, hidden.dtype))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        self.forget(sched.released)
        plans = sched.plans
        batch = self.build_batch(plans)
        input_ids, positions, meta = batch.to_device(self.device)
        # Which rows are canvas rows, and their soft embeddings (zero at a canvas's first step).
        hidden_size = self.model.arch.hidden_size
        canvas = torch.zeros(batch.num_tokens, dtype=torch.bool)
        fresh = torch.zeros(batch.num_tokens, dtype=torch.bool)  # rows of canvases at their first step
        seeds = torch.zeros(batch.num_tokens, dtype=torch.int64)
        soft = torch.zeros(batch.num_tokens, hidden_size, dtype=self.model.embed_tokens.weight.dtype,
                           device=self.device)
        row = 0
        for p in plans:
            for b in p.blocks:
                rows = slice(row + b.start - p.start, row + b.end - p.start)
                canvas[rows] = True
                seeds[rows] = p.sampling.seed
                if p.canvas_step > 0:
                    soft[rows] = self.soft[p.request_id]
                else:
                    fresh[rows] = True
            row += p.num_tokens
        canvas, fresh, seeds = upload([canvas, fresh, seeds], self.device)
        # A canvas starts as random tokens (the request holds placeholders until its first step ends).
        start = random_tokens(seeds, CANVAS_KEY, positions, 0, self.model.arch.vocab_size)
        input_ids = torch.where(fresh, start, input_ids)
        with step_range("forward", self.device):
            hidden = self.forward(batch, inputs=(input_ids, positions, meta),
                                  rows={"canvas": canvas, "soft_embeds": soft})
        blocks = [(p, b) for p in plans for b in p.blocks]
        offsets, at = [], 0
        for plan, block in blocks:
            offsets.append((plan, block, at))
            at += block.end - block.start
        tokens, outcome, non_finite = torch.zeros(0, dtype=torch.int64), None, ()
        if blocks:
            with step_range("sample", self.device):  # DiffusionGemma's sampler decides the tokens itself: no accept
                tokens, outcome, non_finite = self._denoise(plans, blocks, hidden)
        return StepResult(tokens=tokens, blocks=offsets, num_tokens=batch.num_tokens,
                          flops=self.forward_flops(plans), predictions=outcome, non_finite_logits=non_finite)

    def _denoise(self, plans: list[CanvasPlan], blocks: list[tuple[CanvasPlan, LogitBlock]], hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, CanvasOutcome, tuple[str, ...]]:
        """One sampler step for every canvas of the batch, on the device; one sync at the end. Returns the tokens,
        the outcome, and the requests whose canvas has a row whose entropy is not finite."""
        s, size, vocab = self.schedule, self.config.block_size, self.model.arch.vocab_size
        rows, first = [], 0
        for p in plans:
            for b in p.blocks:
                rows.append(torch.arange(b.start - p.start, b.end - p.start) + first)
            first += p.num_tokens
        num = len(blocks)
        steps = torch.tensor([p.canvas_step for p, _ in blocks], dtype=torch.int64)
        seeds = torch.tensor([p.sampling.seed for p, _ in blocks], dtype=torch.int64)
        temps = torch.tensor([s.temperature(p.canvas_step) for p, _ in blocks], dtype=torch.float64)
        positions = torch.cat([torch.arange(b.start, b.end) for _, b in blocks])
        last = torch.from_numpy(np.stack([p.last_argmax for p, _ in blocks]))
        repeats = torch.tensor([p.repeats for p, _ in blocks], dtype=torch.int64)
        rows, steps, seeds, temps, positions, last, repeats = upload(
            [torch.cat(rows), steps, seeds, temps, positions, last, repeats], self.device)
        row_steps, row_seeds = steps.repeat_interleave(size), seeds.repeat_interleave(size)
        sampled, argmax, entropy, soft = chunked_row_statistics(
            self.model, hidden[rows], temps.repeat_interleave(size),
            row_keys(row_seeds ^ SAMPLE_KEY, positions, row_steps), self.use_sampler_kernel)
        entropy = entropy.view(num, size)  # [S, L]
        ordered, order = entropy.sort(dim=-1, stable=True)
        keep_sorted = ordered.cumsum(-1) - ordered <= s.entropy_bound
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted).view(-1)
        noise = random_tokens(row_seeds, RENOISE_KEY, positions, row_steps, vocab)
        canvas = torch.where(keep, sampled, noise)
        stable = (repeats >= s.stability_threshold) & (argmax.view(num, size) == last).all(-1)
        if s.stability_threshold == 0:
            stable = torch.ones_like(stable)
        ended = (stable & (entropy.mean(-1) < s.confidence_threshold)) | (steps + 1 >= s.max_denoising_steps)
        tokens = torch.where(ended.repeat_interleave(size), argmax, canvas)
        for i, (p, _) in enumerate(blocks):
            self.soft[p.request_id] = soft[i * size:(i + 1) * size]
        # A row's entropy is not finite exactly when its capped, tempered logits hold NaN, or, where no cap bounds
        # them, +inf or -inf throughout (tests/kernels/test_diffusion_gemma_sampler.py): such a canvas's tokens would
        # be noise. A cap maps infinities to its bounds, and a -inf among finite logits is a token never drawn.
        finite = entropy.isfinite().all(-1)  # [S]
        per_row = torch.stack([ended, finite]).long().repeat_interleave(size, dim=1)
        host = torch.cat([torch.stack([tokens, argmax]), per_row]).cpu()  # the step's one sync
        failed = tuple(blocks[i][0].request_id for i in np.flatnonzero(host[3, ::size].numpy() == 0))
        return host[0], CanvasOutcome(argmax=host[1].numpy(), ended=host[2].numpy().astype(bool)), failed


def validate_diffusion_gemma(config: Config) -> None:
    # Settings that would reach no code of this strategy, or parts not built for its model.
    if config.mode != SamplingMode.THRESHOLD:
        raise ValueError("config field 'sampling_mode' does not apply to decoding_strategy 'diffusion_gemma', whose "
                         f"acceptance is the entropy bound of generation_config.json; got {config.sampling_mode!r}")
    if config.accept_threshold != DEFAULTS["accept_threshold"]:
        raise ValueError(f"config field 'accept_threshold' does not apply to decoding_strategy 'diffusion_gemma', "
                         f"whose acceptance is the entropy bound of generation_config.json; leave it at its default "
                         f"({DEFAULTS['accept_threshold']!r}), got {config.accept_threshold!r}")
    for name, unset in (("tensor_parallel_size", 1), ("lora_path", None), ("lora_modules", None)):
        if getattr(config, name) != unset:
            raise ValueError(f"config field '{name}' is not built for decoding_strategy 'diffusion_gemma' "
                             f"(model 'diffusion_gemma'); got {getattr(config, name)!r}")
    if config.buffer_size != 1:
        raise ValueError(f"config field 'buffer_size' must be 1 for decoding_strategy 'diffusion_gemma' (one "
                         f"canvas in flight per request), got {config.buffer_size}")
    check_batched_tokens(config, 2 * config.block_size, "a canvas being committed and the next one")


register_strategy(Strategy(
    name="diffusion_gemma", request_cls=DiffusionGemmaRequest, scheduler_cls=Scheduler,
    kv_cache_cls=KVCacheManager, runner_cls=DiffusionGemmaRunner, acceptance_cls=AcceptanceRule,
    default_sampling_mode=SamplingMode.THRESHOLD, supports_prefix_caching=True, validate=validate_diffusion_gemma,
    aliases=("uniform_diffusion",),
))
