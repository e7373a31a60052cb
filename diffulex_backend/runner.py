"""The model runner: turns a SchedulerOutput into tensors, runs one forward, samples, and applies acceptance.

Everything a forward needs is built here and passed down explicitly (AttentionMetadata); nothing is stashed in
module state. Per-request work is a handful of slices; per-position work is batched tensor code.

On CUDA with the Triton kernels (`model.fused_kernels`):
  * a step that fits a decode bucket replays a captured CUDA graph (cuda_graph.py), unless enforce_eager (so does
    a model whose torch modules capture as they are: `model.replays_graphs()`);
  * host inputs travel through pinned memory with non-blocking copies (upload.py);
  * the forward is launched first, and the sampler and acceptance inputs are built on the host while the GPU
    runs it: they depend on the plans only, not on the forward's result;
  * the fused sampler scores rows without top-k/top-p in one pass over the logits, and the acceptance rule is
    one launch (diffulex_kernels.accept_tokens) where its torch form is some forty;
  * the step's one device-to-host sync fetches the accepted tokens, with a flag per row whose logits are not finite.
The next step's scheduling needs those tokens (acceptance decides what the plans feed), so it cannot start
before the sync.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .acceptance import AcceptanceBatch, AcceptanceRule
from .attention import AttentionMetadata, paged_attention_reference
from .config import Config
from .cuda_graph import CUDAGraphForward, PaddedForward
from .flash_attention import FlashAttention
from .forward_batch import ForwardBatch, build_forward_batch, ranges
from .layers.fp8_linear import Fp8Linear
from .layers.lora import LoraBatch
from .lora import lora_batch
from .models.decoder_lm import SoftInputs, TokenMerge
from .plan import LogitBlock, SchedulerOutput, SeqPlan
from .profiling import step_range
from .retention import RetentionStats, select_pages
from .sampling import SampleResult, greedy_over_shards, row_keys, sample_reference, shard_columns
from .upload import upload


@dataclass
class Predictions:
    """The top-k of each predicted position's distribution, for strategies that feed them back (dmax)."""

    ids: torch.Tensor  # [A, K] int64 on the host, most probable first
    probs: torch.Tensor  # [A, K] float32 on the host


@dataclass
class TokenLogprobs:
    """Log-probabilities of a step's predictions, for the requests that ask (RequestSampling.logprobs), aligned
    with StepResult.tokens; rows of other requests hold zeros. They are of the distribution the sampler draws from
    before temperature, top-k and top-p, so they do not depend on those settings."""

    chosen: np.ndarray  # [A] float32: of each row's predicted token
    top_ids: np.ndarray  # [A, K] int64: the K most likely tokens, most likely first (K: the most any request asks)
    top_logprobs: np.ndarray  # [A, K] float32


@dataclass
class StepResult:
    tokens: torch.Tensor  # [A] int64 on the host: every predicted position after acceptance
    blocks: list[tuple[SeqPlan, LogitBlock, int]]  # each predicted block and its offset into `tokens`
    num_tokens: int  # tokens fed
    flops: float  # model FLOPs of the forward
    predictions: Predictions | None = None  # aligned with `tokens`; None unless the runner's strategy wants them
    logprobs: TokenLogprobs | None = None  # None unless a request of the step asks for them
    # Requests with a predicted row whose logits held NaN or infinities this step, in row order: their tokens are
    # noise, so the scheduler ends them with an error instead of applying the step to them.
    non_finite_logits: tuple[str, ...] = ()
    # Page retention: request id -> (indices of its prompt pages to keep, how many prompt pages it has).
    retained_pages: dict[str, tuple[np.ndarray, int]] = dataclasses.field(default_factory=dict)


def kv_cache_layout(model, num_pages: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
                    ) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of this rank's KV cache: the KV heads its attention reads (all of them on one rank), in the
    model's dtype, or with kv_cache_dtype "fp8" as FP8 rows (uint8 [..., head_dim + 4]: every row's head_dim fp8
    values, then every row's float32 scale; kv_store.fp8_rows). A family whose layers differ in KV shape
    (DiffusionGemma) lays out its own."""
    if hasattr(model, "kv_cache_shape"):
        return model.kv_cache_shape(num_pages, page_size), dtype
    arch = model.arch
    shape = (2, arch.num_layers, num_pages, page_size, model.layers[0].attn.num_kv_heads)
    if kv_cache_dtype == "fp8":
        from diffulex_kernels.kv_store import fp8_row_bytes

        return (*shape, fp8_row_bytes(arch.head_dim)), torch.uint8
    return (*shape, arch.head_dim), dtype


def sample(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, confidence_kind: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, *, use_kernel: bool, filtered: bool) -> SampleResult:
    """Token, confidence and logsumexp per row: the fused kernel on CUDA, else the reference.

    The kernel streams each row once and cannot sort it for top-k/top-p, so the sampled rows that ask for them
    are recomputed by the reference and written over its answer. `filtered` says whether any row asks; finding
    the rows costs a sync, so it is paid only then."""
    if not use_kernel:
        return sample_reference(logits, temperature=temperature, keys=keys, confidence_kind=confidence_kind,
                                top_k=top_k, top_p=top_p)
    from diffulex_kernels import sample_and_confidence

    result = SampleResult(*sample_and_confidence(logits, temperature, keys, confidence_kind))
    if filtered:
        rows = (((top_k > 0) | (top_p < 1)) & (temperature > 0)).nonzero().squeeze(1)
        if rows.numel():
            ref = sample_reference(logits[rows], temperature[rows], keys[rows], confidence_kind[rows],
                                   top_k[rows], top_p[rows])
            result.tokens[rows] = ref.tokens
            result.confidence[rows] = ref.confidence
    return result


def profile_peak_memory(model, config: Config, device: torch.device, runner_cls: type["ModelRunner"]
                        ) -> tuple[int, int]:
    """(the peak bytes of the largest step's forward, the peak bytes of its output with the logits and the sampler),
    each beyond what is allocated now, measured by running them once without a KV cache:
    max_num_batched_tokens tokens in one sequence, every row taking the model's own per-row inputs (a flag set, a
    value of ones), then `runner_cls.profile_sampler` over as many rows as a step can predict."""
    tokens = config.max_num_batched_tokens
    rows = min(tokens, config.max_num_reqs * config.buffer_size * config.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        context_lens=torch.zeros(1, dtype=torch.int32, device=device),
        page_tables=torch.full((1, 1), -1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        block_ids=torch.zeros(tokens, dtype=torch.int32, device=device),
        max_seqlen_q=tokens, max_context_len=0, cu_seqlens_q_host=(0, tokens), context_lens_host=(0,),
    )
    row_inputs = {name: torch.ones((tokens, *spec.shape), dtype=spec.dtype, device=device)
                  for name, spec in model.row_inputs().items()}
    with torch.inference_mode():
        hidden = model(torch.zeros(tokens, dtype=torch.int64, device=device),
                       torch.arange(tokens, device=device), meta, None, **row_inputs)
        del row_inputs
        torch.cuda.synchronize(device)
        forward = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.reset_peak_memory_stats(device)
        runner_cls.profile_sampler(model, hidden[:rows])
        del hidden
    torch.cuda.synchronize(device)
    return forward, torch.cuda.max_memory_allocated(device) - before


def banned_logits(blocks: list[tuple[SeqPlan, LogitBlock]], seg_offsets: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of the logits that min_tokens bans this step: a predicted position whose index in the
    output is below its request's min_tokens may not be EOS or a stop token, whichever block it is decoded in; None
    when no position is that early."""
    rows, ids = [], []
    for (plan, block), first_row in zip(blocks, seg_offsets):
        sampling = plan.sampling
        if sampling.banned_ids and block.start < sampling.banned_until:
            early = np.arange(first_row, first_row + min(block.end, sampling.banned_until) - block.start)
            rows.append(np.repeat(early, len(sampling.banned_ids)))
            ids.append(np.tile(np.array(sampling.banned_ids, dtype=np.int64), len(early)))
    if not rows:
        return None
    return torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(ids))


def rows_asking_logprobs(blocks: list[tuple[SeqPlan, LogitBlock]], seg_offsets: list[int]
                         ) -> tuple[torch.Tensor | None, int]:
    """The predicted rows whose requests ask for log-probabilities, and the most top tokens any of them asks for;
    (None, 0) when none asks, and the step computes nothing for them."""
    spans = [(first_row, first_row + block.end - block.start, plan.sampling.logprobs)
             for (plan, block), first_row in zip(blocks, seg_offsets) if plan.sampling.logprobs >= 0]
    if not spans:
        return None, 0
    return ranges([s for s, _, _ in spans], [e for _, e, _ in spans]), max(k for _, _, k in spans)


def token_logprobs(logits: torch.Tensor, result: SampleResult, rows: torch.Tensor, top_n: int) -> list[torch.Tensor]:
    """On the device, for `rows` ([R]) of the step's logits ([A, V], as the sampler saw them): the log-probability
    of each row's sampled token ([R]), and the top_n most likely tokens ([R, top_n] ids, [R, top_n] float32). The
    logsumexp is the sampler's, of the untempered logits."""
    # The difference in the wider of the two dtypes, then float32: a logit of 10 cast first would lose 1e-6.
    lse = result.logsumexp[rows]
    work = torch.promote_types(logits.dtype, lse.dtype)
    chosen = (logits[rows, result.tokens[rows]].to(work) - lse).to(torch.float32)
    if top_n == 0:
        return [chosen, torch.zeros((len(rows), 0), dtype=torch.int64, device=logits.device),
                torch.zeros((len(rows), 0), dtype=torch.float32, device=logits.device)]
    asking = logits if len(rows) == len(logits) else logits.index_select(0, rows)  # no copy when every row asks
    values, ids = asking.topk(top_n, dim=-1)
    return [chosen, ids, (values.to(work) - lse[:, None]).to(torch.float32)]


def finite_flags(result: SampleResult) -> torch.Tensor:  # [A] int64
    """0 for each row whose logits hold NaN or +inf (its logsumexp is then NaN or +inf) or are -inf throughout
    (nothing could be sampled), else 1; int64, so that it rides in read_back as it is. Read from the sampler's
    logsumexp, which every sampling path computes (the fused kernel, the reference, the ranks' shares), so every
    path flags the same rows."""
    return result.logsumexp.isfinite().to(torch.int64)


def requests_of_rows(rows: np.ndarray, blocks: list[tuple[SeqPlan, LogitBlock, int]]) -> tuple[str, ...]:
    """The ids of the requests whose predicted blocks (each with its offset into the step's rows) hold `rows`
    ([R], ascending), once each, in row order."""
    if not rows.size:
        return ()
    starts = np.array([at for _, _, at in blocks])
    owners = np.searchsorted(starts, rows, side="right") - 1
    return tuple(dict.fromkeys(blocks[i][0].request_id for i in owners.tolist()))


def read_back(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host, in one device-to-host copy: int64 tensors as they are and float tensors as their
    float32 bits, in one int64 buffer. Float tensors come back as float32."""
    flat = [t.reshape(-1) if t.dtype == torch.int64
            else t.reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64) for t in tensors]
    host = torch.cat(flat).cpu()
    out = []
    for tensor, piece in zip(tensors, host.split([f.numel() for f in flat])):
        if tensor.dtype != torch.int64:
            piece = piece.to(torch.int32).view(torch.float32)
        out.append(piece.view(tensor.shape))
    return out


class ModelRunner:
    def __init__(self, config: Config, model, num_pages: int, acceptance: AcceptanceRule, device: torch.device,
                 dtype: torch.dtype):
        self.config = config
        self.model = model
        self.acceptance = acceptance
        self.device = device
        self.pin_memory = device.type == "cuda"  # host inputs upload without waiting for the device
        attention_fn = model.layers[0].attn.attention_fn
        # Prompts' forwards, and the cached contexts of wide GQA groups, go to flash-attn.
        self.flash_attn = isinstance(attention_fn, FlashAttention)
        self.shift = 1 if model.arch.shifted else 0
        # Shifted models: the hidden state of each request's last committed position, which predicts the first
        # position after it once that position is no longer fed. By request id; forget() drops an entry.
        self.carry_hidden: dict[str, torch.Tensor] = {}
        shape, cache_dtype = kv_cache_layout(model, num_pages, config.page_size, dtype, config.kv_cache_dtype)
        self.kv_cache = torch.zeros(shape, dtype=cache_dtype, device=device) if num_pages else None
        self.flops_per_token = 2.0 * model.arch.num_params()
        self.attn_flops_per_pair = 4.0 * model.arch.num_layers * model.arch.num_heads * model.arch.head_dim
        self.use_kernels = model.fused_kernels
        self.padded_forward: PaddedForward | None = None
        self.token_merge = self.token_merge_for(config)
        if model.replays_graphs() and not config.enforce_eager and self.kv_cache is not None:
            self.padded_forward = CUDAGraphForward(model, self.kv_cache, config, device, self.token_merge)

    @classmethod
    def compile_kernels(cls, config: Config, model, device: torch.device, dtype: torch.dtype) -> None:
        """Compiles every sampler and attention launch the steps can take, and loads it onto the device, so that
        none compiles while requests wait. model_setup.build_runner runs it once, before the KV cache's sizing,
        which then counts the memory the loaded kernels take. The graphs' forward compiles as the warm-up captures
        it."""
        if model.fused_kernels:
            from diffulex_kernels.sampling import compile_launches as compile_sampler

            compile_sampler(model.arch.vocab_size, dtype, device)
            if model.tp.size > 1 and cls.token_merge_for(config) is None:  # greedy steps sample over the ranks' shares
                from diffulex_kernels.sampling import compile_shard_launches

                columns = model.embed_tokens.num_embeddings
                held, mask_column = shard_columns(columns, model.vocab_start, model.arch.vocab_size,
                                                  config.mask_token_id)
                compile_shard_launches(columns, model.vocab_start, held, mask_column, model.tp.size, dtype, device)
        attention_fn = model.layers[0].attn.attention_fn
        flash_attn = isinstance(attention_fn, FlashAttention)
        blocks_attention = attention_fn.blocks if flash_attn else attention_fn
        if blocks_attention not in (None, paged_attention_reference):  # the Triton kernel
            from diffulex_kernels.attention import compile_launches as compile_attention

            cache_dtype = kv_cache_layout(model, 1, config.page_size, dtype, config.kv_cache_dtype)[1]
            # Each layer kind's heads, head size and window (DiffusionGemma's sliding and full layers differ).
            layouts = {(layer.attn.num_heads, layer.attn.num_kv_heads, layer.attn.head_dim, layer.attn.window)
                       for layer in model.layers}
            kv_fp8 = config.kv_cache_dtype == "fp8"
            # An fp8 o_proj takes the attention's output cast per token, by the merge where the context is split.
            fp8_out = any(isinstance(getattr(layer.attn, "o_proj", None), Fp8Linear) for layer in model.layers)
            for heads, kv_heads, head_dim, window in layouts:
                flash_context = flash_attn and attention_fn.takes_context_of(heads, kv_heads, cache_dtype, dtype)
                compile_attention(heads, kv_heads, head_dim, config.page_size, dtype, device, window=window,
                                  kv_fp8=kv_fp8, prior=flash_context, fp8_out=fp8_out)
                if flash_attn:
                    attention_fn.compile(heads, kv_heads, head_dim, dtype, device, config.page_size, cache_dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        self.forget(sched.released)
        plans = sched.plans
        batch = self.build_batch(plans)
        with step_range("forward", self.device):  # on CUDA the launch; the kernels show under it in a trace
            hidden = self.forward(batch, lora_batch(plans))  # queued on the device; the host goes on below
        self._save_carry(plans, hidden)
        blocks = [(p, b) for p in plans for b in p.blocks]
        no_tokens = (torch.zeros(0, dtype=torch.int64), np.zeros(0, dtype=np.int64), None, None)
        tokens, non_finite_rows, predictions, logprobs = self._predict(plans, blocks, hidden) if blocks else no_tokens
        offsets, at = [], 0
        for plan, block in blocks:
            offsets.append((plan, block, at))
            at += block.end - block.start
        measuring = [p for p in plans if p.retention is not None]  # page retention chooses for these
        retained = self.choose_retained_pages(measuring) if measuring else {}
        flops = self.forward_flops(plans) + self.forward_flops(measuring)
        return StepResult(tokens=tokens, blocks=offsets, num_tokens=batch.num_tokens, flops=flops,
                          predictions=predictions, logprobs=logprobs, retained_pages=retained,
                          non_finite_logits=requests_of_rows(non_finite_rows, offsets))

    @staticmethod
    def profile_sampler(model, hidden: torch.Tensor) -> None:
        """The logits and the sampler over `hidden`'s rows, as a step runs them (profile_peak_memory)."""
        rows = hidden.shape[0]
        logits = model.compute_logits(hidden)
        ones = torch.ones(rows, device=hidden.device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
        sample(logits, ones, zeros, zeros, zeros, ones, use_kernel=model.fused_kernels, filtered=False)

    def forward_flops(self, plans: list[SeqPlan]) -> float:
        """Model FLOPs of a forward over the plans: the weights' per token, and attention's per (query, key) pair
        over the context a sequence reads (its kept pages only) and its own fed tokens."""
        page = self.config.page_size
        tokens = sum(p.num_tokens for p in plans)
        pairs = sum(p.num_tokens * (p.context_len - p.num_dropped_pages * page + p.num_tokens) for p in plans)
        return self.flops_per_token * tokens + self.attn_flops_per_pair * pairs

    def choose_retained_pages(self, plans: list[SeqPlan]) -> dict[str, tuple[np.ndarray, int]]:
        """For plans that ask (retention.py): one eager forward of their rows, storing nothing, that measures the
        attention each context page gets per layer and head; then the pages each request keeps."""
        chosen = [dataclasses.replace(p, cache_index=np.full_like(p.cache_index, -1)) for p in plans]
        batch = build_forward_batch(chosen, self.config.page_size, self.config.max_model_len, pin_memory=False)
        input_ids, positions, meta = batch.to_device(self.device)
        meta.retention_stats = stats = RetentionStats(self.config.page_size)
        soft = batch.soft_to_device(self.device) if self.token_merge is not None else None
        soft = None if soft is None else SoftInputs(*soft, self.token_merge)
        self.model(input_ids, positions, meta, self.kv_cache, soft, lora=lora_batch(chosen))  # as the step saw it
        kept = {}
        for seq, plan in enumerate(chosen):
            # [prompt pages, heads of every layer]; under tensor parallelism, every rank's heads.
            pages = plan.retention.num_pages
            scores = self.model.tp.gather_columns(stats.scores(seq, pages).to(self.device)).cpu().numpy()
            kept[plan.request_id] = (select_pages(scores, plan.retention.ratio, plan.retention.head_select), pages)
        return kept

    @staticmethod
    def token_merge_for(config: Config) -> TokenMerge | None:
        """The soft-input setting every forward of such a runner takes (dmax), or None: inputs are token ids."""
        return None

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of requests that finished, were aborted, or were preempted (they recompute from
        scratch): the plan's released ids, before its step."""
        for request_id in request_ids:
            self.carry_hidden.pop(request_id, None)

    def build_batch(self, plans: list[SeqPlan]) -> ForwardBatch:
        return build_forward_batch(plans, self.config.page_size, self.config.max_model_len, self.pin_memory,
                                   find_dense=self.flash_attn)

    def forward(self, batch: ForwardBatch, lora: LoraBatch | None = None,
                inputs: tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None = None,
                rows: dict[str, torch.Tensor] | None = None) -> torch.Tensor:  # [T, hidden]
        """The model forward: a graph replay when the batch fits a bucket, else eager. A batch with adapter rows
        replays its bucket's graph with the LoRA delta; one without replays the graph without it. `inputs`: the
        batch's (input_ids, positions, metadata) when the runner already has them on the device, with ids it
        changed there (a replay takes the ids: its positions and metadata are the batch's own, copied with the rest
        of its flat buffer); `rows`: the model's inputs per row (model.row_inputs())."""
        bucket = None
        if self.padded_forward is not None:
            bucket = self.padded_forward.bucket_for(batch, lora)
        if bucket is not None:
            return self.padded_forward.run(bucket, batch, lora, None if inputs is None else inputs[0], rows)
        input_ids, positions, meta = batch.to_device(self.device) if inputs is None else inputs
        soft = batch.soft_to_device(self.device) if self.token_merge is not None else None
        soft = None if soft is None else SoftInputs(*soft, self.token_merge)
        return self.model(input_ids, positions, meta, self.kv_cache, soft, lora=lora, **(rows or {}))

    def logit_rows(self, plans: list[SeqPlan]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The hidden row that predicts each predicted position: its own row, or the row before it for shifted
        models, or the saved hidden of the last committed position when that one is not fed (appended after
        the T forward rows, in the order of the returned list)."""
        logit_rows, carry = [], []
        total = sum(p.num_tokens for p in plans)
        first_row = 0
        for p in plans:
            for b in p.blocks:
                rows = torch.arange(b.start, b.end) - self.shift - p.start + first_row
                if b.start - self.shift < p.start:
                    rows[0] = total + len(carry)
                    carry.append(self.carry_hidden[p.request_id])
                logit_rows.append(rows)
            first_row += p.num_tokens
        return (torch.cat(logit_rows) if logit_rows else torch.zeros(0, dtype=torch.int64)), carry

    def _save_carry(self, plans: list[SeqPlan], hidden: torch.Tensor) -> None:
        if not self.shift:
            return
        row = 0
        for p in plans:
            last = p.committed_end - 1
            if p.start <= last < p.end:
                self.carry_hidden[p.request_id] = hidden[row + last - p.start].clone()
            row += p.num_tokens

    def _predict(self, plans: list[SeqPlan], blocks: list[tuple[SeqPlan, LogitBlock]],
                 hidden: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, Predictions | None, TokenLogprobs | None]:
        """Sample every predicted position, then apply the acceptance rule; returns host tokens, the rows whose
        logits are not finite (ascending), and predictions where the strategy asks for them and log-probabilities
        where a request does."""
        # Host side first: none of it waits for the forward. Values are gathered per block (segment), then
        # repeated per predicted position in one call per dtype.
        logit_rows, carry = self.logit_rows(plans)
        lengths = torch.tensor([b.end - b.start for _, b in blocks], dtype=torch.int64)
        seg_ints = torch.tensor([[p.sampling.seed, p.step, int(p.sampling.confidence_kind), p.sampling.top_k,
                                  b.num_transfer] for p, b in blocks], dtype=torch.int64)  # [S, 5]
        seg_floats = torch.tensor([[s.temperature, s.top_p, s.accept_threshold, s.remask_threshold]
                                   for s in (p.sampling for p, _ in blocks)], dtype=torch.float32)  # [S, 4]
        row_ints = seg_ints[:, :4].repeat_interleave(lengths, dim=0)  # [A, 4]
        row_floats = seg_floats[:, :2].repeat_interleave(lengths, dim=0)  # [A, 2]
        positions = ranges([b.start for _, b in blocks], [b.end for _, b in blocks])
        seg_offsets = torch.zeros(len(blocks) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=seg_offsets[1:])
        filtered = any(p.sampling.top_k > 0 or p.sampling.top_p < 1 for p, _ in blocks)
        # Built and uploaded only for requests that use them: a step without min_tokens or logprobs does none of it.
        first_rows = seg_offsets.tolist()
        banned = banned_logits(blocks, first_rows)  # (rows, token ids) or None
        host_logprob_rows, top_n = rows_asking_logprobs(blocks, first_rows)
        if banned is not None:
            banned = tuple(upload(list(banned), self.device))
        logprob_rows = None if host_logprob_rows is None else upload([host_logprob_rows], self.device)[0]
        (logit_rows, current, keys, temperature, confidence_kind, top_k, top_p, seg_offsets, seg_first, seg_enabled,
         seg_accept, seg_remask, seg_num_transfer) = upload([
            logit_rows,
            torch.from_numpy(np.concatenate([p.token_ids[b.start - p.start:b.end - p.start] for p, b in blocks])),
            row_keys(row_ints[:, 0], positions, row_ints[:, 1]),
            row_floats[:, 0],
            row_ints[:, 2],
            row_ints[:, 3],
            row_floats[:, 1],
            seg_offsets,
            torch.tensor([b.is_first for _, b in blocks]),
            torch.tensor([b.enabled for _, b in blocks]),
            seg_floats[:, 2],
            seg_floats[:, 3],
            seg_ints[:, 4],
        ], self.device)

        with step_range("sample", self.device):
            if carry:
                hidden = torch.cat([hidden, torch.stack(carry).to(hidden.dtype)])
            model, mask = self.model, self.acceptance.mask_token_id
            if self.samples_over_shards(blocks, exact_rows=banned is not None or logprob_rows is not None):
                logits = model.compute_logits(hidden[logit_rows], gather=False)  # [A, this rank's vocabulary]
                result, current_logit = greedy_over_shards(logits, model.vocab_start, model.arch.vocab_size, mask,
                                                           current, confidence_kind, model.tp,
                                                           use_kernel=self.use_kernels)
            else:
                logits = model.compute_logits(hidden[logit_rows])  # [A, vocab]
                # Predicting the mask token would leave a position masked after "accepting" it, forever.
                logits[:, mask] = float("-inf")
                if banned is not None:  # min_tokens: EOS and stop tokens cannot be output yet at these positions
                    logits[banned] = float("-inf")
                result = sample(logits, temperature, keys, confidence_kind, top_k, top_p,
                                use_kernel=self.use_kernels, filtered=filtered)
                current_logit = logits.gather(1, current[:, None]).squeeze(1)
        batch = AcceptanceBatch(
            current=current,
            predicted=result.tokens,
            confidence=result.confidence,
            current_logit=current_logit,
            logsumexp=result.logsumexp,
            seg_offsets=seg_offsets,
            max_segment_len=int(lengths.max()),
            seg_first=seg_first,
            seg_enabled=seg_enabled,
            seg_accept_threshold=seg_accept,
            seg_remask_threshold=seg_remask,
            seg_num_transfer=seg_num_transfer,
        )
        with step_range("accept", self.device):
            tokens, top = self.accept(batch, logits, blocks)
        wanted = [tokens, finite_flags(result)]
        if top is not None:
            wanted += [top[0], top[1]]
        if logprob_rows is not None:
            wanted += token_logprobs(logits, result, logprob_rows, top_n)
        host = read_back(wanted)  # the step's one device-to-host sync
        predictions = Predictions(host[2], host[3]) if top is not None else None
        logprobs = None
        if logprob_rows is not None:
            rows = host_logprob_rows.numpy()
            chosen, top_ids, top_logprobs = (t.numpy() for t in host[-3:])
            logprobs = TokenLogprobs(np.zeros(len(tokens), np.float32), np.zeros((len(tokens), top_n), np.int64),
                                     np.zeros((len(tokens), top_n), np.float32))
            logprobs.chosen[rows], logprobs.top_ids[rows], logprobs.top_logprobs[rows] = chosen, top_ids, top_logprobs
        return host[0], np.flatnonzero(host[1].numpy() == 0), predictions, logprobs

    def samples_over_shards(self, blocks: list[tuple[SeqPlan, LogitBlock]], exact_rows: bool = False) -> bool:
        """Under tensor parallelism, a step whose rows are all greedy samples from each rank's share of the logits:
        gathering the whole rows would move rows x vocabulary values a step, 0.5 GB in float32 at 1024 rows of
        LLaDA's 126464. Strategies that feed predictions back (dmax) read the whole rows, and so does a step with
        `exact_rows`: one that bans tokens (min_tokens) or returns log-probabilities."""
        if self.model.tp.size == 1 or self.token_merge is not None or exact_rows:
            return False
        return all(p.sampling.temperature == 0 for p, _ in blocks)

    def accept(self, batch: AcceptanceBatch, logits: torch.Tensor, blocks: list[tuple[SeqPlan, LogitBlock]]
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """[A] tokens after this step, on the device, and the predictions' top-k ([A, K] ids, [A, K]
        probabilities) where the strategy feeds them back."""
        return self.acceptance(batch, use_kernel=self.use_kernels), None
