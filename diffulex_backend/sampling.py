"""Per-request sampling parameters, the sampling modes, and the batched token sampler with its confidence measures.

`sample_reference` is the CPU path and the reference of the fused GPU kernel. Randomness comes from a
counter-based hash of (request seed, position, step), not from a stateful generator, so a seeded request
samples the same tokens whatever else shares its batch, and the kernel reproduces the same noise.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

import torch

from .refusal import Refusal


class SamplingMode(enum.Enum):
    THRESHOLD = "threshold"  # accept every masked position whose confidence clears accept_threshold
    TOPK = "topk"  # LLaDA's schedule: a fixed number of the most confident positions per step


# Each sampling mode -> (the parameter it never reads, what it reads instead to choose the positions a step accepts).
UNREAD_IN_MODE = {
    SamplingMode.THRESHOLD: ("steps", "each step accepts the positions whose confidence clears 'accept_threshold'"),
    SamplingMode.TOPK: ("accept_threshold", "each step accepts the number of positions that 'steps' schedules"),
}


class Confidence(enum.IntEnum):
    PROB = 0  # probability of the chosen token
    MARGIN = 1  # top-1 minus top-2 probability
    NEG_ENTROPY = 2  # sum p log p: close to 0 when the distribution is peaked


INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # most likely tokens a request may ask for at each output position (vLLM's default bound)
MAX_PROFILE_STEPS = 1000  # the most engine steps one request may record, which bounds the trace file it writes


@dataclass
class SamplingParams:
    """Every value is checked against the range the engine can represent (int32 counts, a uint64 seed, finite
    float32 numbers), so a request is refused here, with the field's name, rather than failing a step later."""

    max_tokens: int = 128
    min_tokens: int = 0  # EOS and stop tokens among the first min_tokens outputs do not end the request
    temperature: float = 0.0  # 0 is greedy, and so is anything below GREEDY_TEMPERATURE
    top_k: int = 0  # 0 keeps the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    confidence: str = "prob"
    steps: int | None = None  # denoising steps per block for the top-k schedule; None means one token per step
    accept_threshold: float | None = None  # None takes the engine's setting
    remask_threshold: float | None = None
    sub_block_size: int | None = None  # fast_dllm_v2; None takes the engine's setting
    lora_name: str | None = None  # an adapter of the engine's lora_modules; None runs the model as loaded
    edit_threshold: float | None = None  # dmax; None takes the engine's setting
    retention_ratio: float | None = None  # the share of prompt KV pages kept (sparse attention); None: the engine's
    head_select: bool | None = None  # how the kept pages are ranked; None: the engine's setting
    # None returns no log-probabilities; k returns each output token's and the k most likely tokens' at its position
    logprobs: int | None = None
    # N records a trace of the engine's next N steps (profiling.py); needs the engine's profile_dir
    profile_steps: int | None = None

    def __post_init__(self):
        def fail(name, allowed):
            raise Refusal(f"sampling parameter '{name}' must be {allowed}, got {_shown(getattr(self, name))}", name)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, low, high in (("max_tokens", 1, INT32_MAX), ("min_tokens", 0, INT32_MAX), ("top_k", 0, INT32_MAX)):
            if not _is_int(getattr(self, name)) or not low <= getattr(self, name) <= high:
                fail(name, f"an integer in [{low}, {high}]" + (" (0 disables it)" if name == "top_k" else ""))
        if self.min_tokens > self.max_tokens:
            fail("min_tokens", f"at most max_tokens ({self.max_tokens})")
        if not _is_finite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            fail("temperature", f"a finite number in [0, {FLOAT32_MAX:.7g}]")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "a number in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= UINT64_MAX):
            fail("seed", f"an integer in [0, {UINT64_MAX}] or null")
        if (not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in self.stop)):
            fail("stop", f"a list of at most {MAX_STOP_STRINGS} non-empty strings")
        if (not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids)):
            fail("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {INT32_MAX}]")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "true or false")
        if not isinstance(self.confidence, str) or self.confidence not in CONFIDENCE_NAMES:
            fail("confidence", f"one of {sorted(CONFIDENCE_NAMES)}")
        if self.steps is not None and (not _is_int(self.steps) or not 1 <= self.steps <= INT32_MAX):
            fail("steps", f"an integer in [1, {INT32_MAX}] or null")
        if self.sub_block_size is not None and (not _is_int(self.sub_block_size)
                                                or not 1 <= self.sub_block_size <= INT32_MAX):
            fail("sub_block_size", f"an integer in [1, {INT32_MAX}] or null")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            fail("lora_name", "a non-empty string or null")
        if self.retention_ratio is not None and (not _is_finite(self.retention_ratio)
                                                 or not 0 < self.retention_ratio <= 1):
            fail("retention_ratio", "a number in (0, 1] or null")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or null")
        if self.profile_steps is not None and (not _is_int(self.profile_steps)
                                               or not 1 <= self.profile_steps <= MAX_PROFILE_STEPS):
            fail("profile_steps", f"an integer in [1, {MAX_PROFILE_STEPS}] or null")
        if self.head_select is not None and not isinstance(self.head_select, bool):
            fail("head_select", "true, false or null")
        for name in ("accept_threshold", "remask_threshold", "edit_threshold"):
            value = getattr(self, name)
            if value is not None and (not _is_finite(value) or not 0 <= value <= 1):
                fail(name, "a number in [0, 1] or null")

    @property
    def confidence_kind(self) -> Confidence:
        return CONFIDENCE_NAMES[self.confidence]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        if not isinstance(values, dict):
            raise Refusal(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise Refusal(f"unknown sampling parameter(s) {unknown}; allowed: {cls.field_names()}", "unknown")
        return cls(**values)


# Temperatures below this are greedy: dividing logits by a smaller one overflows float32.
GREEDY_TEMPERATURE = 1e-5


CONFIDENCE_NAMES = {"prob": Confidence.PROB, "margin": Confidence.MARGIN, "neg_entropy": Confidence.NEG_ENTROPY}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


def _shown(value) -> str:
    """The value as a message quotes it, cut short: a huge value must not make a huge error response."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on uint32 values held in int64 (products wrap; the low 32 bits are exact)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uint32 noise key per predicted position: a function of (request seed, position, request step)."""
    return mix32(seeds ^ mix32(positions * 0x9E3779B1 + mix32(steps)))


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N, V] in (0, 1)
    j = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = mix32(keys[:, None] ^ mix32(j)[None, :])
    # 23 bits, so that (x + 0.5) is exact in float32 and u stays strictly below 1 (u = 1 would make an
    # infinite Gumbel value and pick that token whatever its logit).
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [N] int64: the sampled (or greedy) token
    confidence: torch.Tensor  # [N] float32: the row's confidence measure
    logsumexp: torch.Tensor  # [N] float32: to score other tokens of the row later: p(t) = exp(logit_t - lse)


def sample_reference(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float32, 0 for greedy
    keys: torch.Tensor,  # [N] int64 noise keys from row_keys
    confidence_kind: torch.Tensor,  # [N] int64 Confidence values
    top_k: torch.Tensor | None = None,  # [N] int64, 0 = off
    top_p: torch.Tensor | None = None,  # [N] float32, 1 = off
) -> SampleResult:
    """Choose a token per row and score it. Confidence is measured on the untempered distribution."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[:, None])
    tokens = logits.argmax(dim=-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        rows = sampled.nonzero().squeeze(1)
        scaled = logits[rows] / temperature[rows, None]
        scaled = _filter_top_k_top_p(scaled, None if top_k is None else top_k[rows], None if top_p is None else top_p[rows])
        gumbel = -torch.log(-torch.log(uniform_noise(keys[rows], logits.shape[1])))
        tokens[rows] = (scaled + gumbel).argmax(dim=-1)
    top2 = probs.topk(2, dim=-1).values
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    neg_entropy = torch.special.xlogy(probs, probs).sum(-1)  # 0 log 0 = 0 where a logit is -inf
    confidence = torch.where(
        confidence_kind == Confidence.PROB, chosen,
        torch.where(confidence_kind == Confidence.MARGIN, top2[:, 0] - top2[:, 1], neg_entropy),
    )
    return SampleResult(tokens=tokens, confidence=confidence, logsumexp=lse)


def shard_columns(columns: int, vocab_start: int, vocab_size: int, mask_token_id: int) -> tuple[int, int]:
    """(columns of a rank's share that hold vocabulary entries, the mask token's column there or -1): the last
    rank's columns past the vocabulary are the head's padding rows."""
    held = min(columns, vocab_size - vocab_start)
    return held, mask_token_id - vocab_start if 0 <= mask_token_id - vocab_start < held else -1


def greedy_over_shards(
    logits: torch.Tensor,  # [N, C]: this rank's columns of the vocabulary, from vocab_start (padding past vocab_size)
    vocab_start: int,
    vocab_size: int,
    mask_token_id: int,  # never predicted: its logit reads as -inf
    current: torch.Tensor,  # [N] int64: each row's current token, whose logit the acceptance rule reads
    confidence_kind: torch.Tensor,  # [N] int64 Confidence values
    tp,  # tensor_parallel.TensorParallel
    *,
    use_kernel: bool,
) -> tuple[SampleResult, torch.Tensor]:
    """sample_reference for greedy rows whose vocabulary is split over tensor-parallel ranks, and each row's logit
    of its current token (-inf for the mask token), from one all-gather of a few numbers a row per rank instead of
    the rows' whole logits: each rank's best two logits with the first one's id, its logsumexp and entropy term, and
    the current token's logit where it holds it. Ties go to the lower token id, as argmax over the whole row does.
    On CUDA two kernels (diffulex_kernels.sampling's shard_stats, merge_shard_stats) stand around the all-gather;
    the tensor ops here are their reference."""
    columns = logits.shape[1]
    held, mask_column = shard_columns(columns, vocab_start, vocab_size, mask_token_id)
    if use_kernel:
        from diffulex_kernels.sampling import merge_shard_stats, shard_stats

        stats = shard_stats(logits, current, vocab_start, held, mask_column)
        merged, current_logit = merge_shard_stats(tp.gather(stats).flatten(0, 1), confidence_kind, tp.size)
        return SampleResult(*merged), current_logit
    work = torch.promote_types(logits.dtype, torch.float32)
    local = logits.to(work)
    if held < columns or mask_column >= 0:
        local = local.clone() if local is logits else local
        local[:, held:] = float("-inf")
        if mask_column >= 0:
            local[:, mask_column] = float("-inf")
    top1_local, top1_index = local.max(dim=-1)  # the first maximum: the lowest id among equals
    top2_local = local.topk(2, dim=-1).values[:, 1]
    owner = (current >= vocab_start) & (current < vocab_start + held)
    current_logit = local.gather(1, (current - vocab_start).clamp(0, held - 1)[:, None]).squeeze(1)
    local_lse = torch.logsumexp(local, dim=-1)
    q = torch.exp(local - local_lse[:, None])
    # Token ids travel as floats: exact up to 2^24, far past any vocabulary.
    stats = torch.stack([top1_local, top2_local, (top1_index + vocab_start).to(work),
                         local_lse, torch.special.xlogy(q, q).sum(-1),
                         torch.where(owner, current_logit, 0)], dim=1)  # [N, 6]
    everyone = tp.gather(stats)  # [ranks, N, 6]
    # The first maximum over ranks is the lowest id among the best, since rank r's ids precede rank r + 1's.
    top1, winner = everyone[:, :, 0].max(dim=0)
    runners_up = everyone[:, :, 0].scatter(0, winner[None], float("-inf"))
    top2 = torch.maximum(everyone[:, :, 1].max(dim=0).values, runners_up.max(dim=0).values)
    tokens = everyone[:, :, 2].gather(0, winner[None]).squeeze(0).to(torch.int64)
    lse = torch.logsumexp(everyone[:, :, 3], dim=0)
    # sum p log p over the row, from each rank's sum of q log q over its share (q = p scaled by exp(lse - rank's lse))
    weight = torch.exp(everyone[:, :, 3] - lse)
    # A rank whose share is all -inf (its one column the mask token) holds no mass: its term is 0, not NaN.
    neg_entropy = torch.where(weight > 0, weight * (everyone[:, :, 4] + everyone[:, :, 3] - lse), 0).sum(0)
    p1, p2 = torch.exp(top1 - lse), torch.exp(top2 - lse)
    confidence = torch.where(confidence_kind == Confidence.PROB, p1,
                             torch.where(confidence_kind == Confidence.MARGIN, p1 - p2, neg_entropy))
    return SampleResult(tokens=tokens, confidence=confidence, logsumexp=lse), everyone[:, :, 5].sum(0)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    need_k = top_k is not None and bool((top_k > 0).any())
    need_p = top_p is not None and bool((top_p < 1).any())
    if not (need_k or need_p):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    rank = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    if need_k:
        k = torch.where(top_k > 0, top_k, scaled.shape[1])
        drop |= rank >= k[:, None]
    if need_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly ahead of each token; the top token always stays
        drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
