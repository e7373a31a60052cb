"""The model runner: turns a SchedulerOutput into tensors, runs one forward, samples, and applies acceptance.

Everything a forward needs is built here and passed down explicitly (AttentionMetadata); nothing is stashed in
module state. Per-request work is a handful of slices; per-position work is batched tensor code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import AcceptanceBatch, AcceptanceSampler
from .attention import AttentionMetadata
from .config import Config
from .kv_cache import KVCacheManager
from .request import LogitBlock, SeqPlan
from .sampling import row_keys, sample_reference
from .scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [A]: row of the hidden state that predicts each predicted position
    carry: list[torch.Tensor]  # hidden rows appended after the T forward rows (shifted models)


@dataclass
class StepResult:
    tokens: torch.Tensor  # [A] int64 on the host: every predicted position after acceptance
    blocks: list[tuple[SeqPlan, LogitBlock, int]]  # each predicted block and its offset into `tokens`
    num_tokens: int  # tokens fed
    flops: float  # model FLOPs of the forward


def _ranges(starts: list[int], ends: list[int]) -> torch.Tensor:
    """cat(arange(s, e) for s, e in zip(starts, ends)), without a Python loop over positions."""
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int64)
    if int(lengths.sum()) == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - (lengths.cumsum(0) - lengths), lengths)
    return torch.arange(int(lengths.sum())) + offsets


def _repeat(values: list, counts: list[int], dtype) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=dtype), torch.tensor(counts, dtype=torch.int64))


def kv_cache_shape(model, num_pages: int, page_size: int) -> tuple[int, ...]:
    arch = model.arch
    return (2, arch.num_layers, num_pages, page_size, arch.num_kv_heads, arch.head_dim)


class ModelRunner:
    def __init__(self, config: Config, model, kv_cache: KVCacheManager, sampler: AcceptanceSampler,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.kv_manager = kv_cache
        self.sampler = sampler
        self.device = device
        self.shift = 1 if model.arch.shifted else 0
        shape = kv_cache_shape(model, kv_cache.num_pages, config.page_size)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device) if kv_cache.num_pages else None
        self.flops_per_token = 2.0 * model.arch.num_params()
        self.attn_flops_per_pair = 4.0 * model.arch.num_layers * model.arch.num_heads * model.arch.head_dim

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        plans = sched.plans
        inputs = self.prepare_inputs(plans)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)
        self._save_carry(plans, hidden)
        if inputs.carry:
            hidden = torch.cat([hidden, torch.stack(inputs.carry).to(hidden.dtype)])
        blocks = [(p, b) for p in plans for b in p.blocks]
        tokens = self._predict(blocks, hidden[inputs.logit_rows.to(self.device)]) if blocks else torch.zeros(0, dtype=torch.int64)
        offsets, at = [], 0
        for plan, block in blocks:
            offsets.append((plan, block, at))
            at += block.end - block.start
        pairs = sum(p.num_tokens * (p.context_len + p.num_tokens) for p in plans)
        flops = self.flops_per_token * inputs.input_ids.numel() + self.attn_flops_per_pair * pairs
        return StepResult(tokens=tokens, blocks=offsets, num_tokens=inputs.input_ids.numel(), flops=flops)

    def prepare_inputs(self, plans: list[SeqPlan]) -> ModelInputs:
        starts = [p.start for p in plans]
        ends = [p.end for p in plans]
        counts = [p.num_tokens for p in plans]
        input_ids = torch.cat([p.req.tokens[p.start:p.end] for p in plans])
        positions = _ranges(starts, ends)
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        context_lens = [p.context_len for p in plans]
        max_pages = max(1, max(len(p.req.page_table) for p in plans))
        page_tables = torch.full((len(plans), max_pages), -1, dtype=torch.int32)
        for i, p in enumerate(plans):
            if p.req.page_table:
                page_tables[i, : len(p.req.page_table)] = torch.tensor(p.req.page_table, dtype=torch.int32)
        # Logical cache index -> flat slot through each token's own page table row.
        cache_index = torch.cat([p.cache_index for p in plans])
        seq_of_token = _repeat(list(range(len(plans))), counts, torch.int64)
        ps = self.config.page_size
        clamped = cache_index.clamp(min=0)
        page = page_tables[seq_of_token, clamped // ps].long() if cache_index.numel() else clamped
        slot_mapping = torch.where(cache_index >= 0, page * ps + clamped % ps, -1)

        # The hidden row that predicts each predicted position: its own row, or the row before it for
        # shifted models, or the saved hidden of the last committed position when that one is not fed.
        logit_rows, carry = [], []
        total = cu[-1]
        for i, p in enumerate(plans):
            for b in p.blocks:
                rows = torch.arange(b.start, b.end) - self.shift - p.start + cu[i]
                if b.start - self.shift < p.start:
                    rows[0] = total + len(carry)
                    carry.append(p.req.carry_hidden)
                logit_rows.append(rows)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            page_tables=page_tables.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            block_ids=torch.cat([p.block_ids for p in plans]).to(self.device),
            max_seqlen_q=max(counts),
            max_context_len=max(context_lens),
            cu_seqlens_q_host=tuple(cu),
            context_lens_host=tuple(context_lens),
        )
        return ModelInputs(
            input_ids=input_ids.to(self.device), positions=positions.to(self.device), meta=meta,
            logit_rows=torch.cat(logit_rows) if logit_rows else torch.zeros(0, dtype=torch.int64), carry=carry,
        )

    def _save_carry(self, plans: list[SeqPlan], hidden: torch.Tensor) -> None:
        if not self.shift:
            return
        row = 0
        for p in plans:
            last = p.req.committed_end - 1
            if p.start <= last < p.end:
                p.req.carry_hidden = hidden[row + last - p.start].clone()
            row += p.num_tokens

    def _predict(self, blocks: list[tuple[SeqPlan, LogitBlock]], hidden: torch.Tensor) -> torch.Tensor:
        """Sample every predicted position, then apply the acceptance rule; returns host tokens."""
        lengths = [b.end - b.start for _, b in blocks]
        reqs = [p.req for p, _ in blocks]
        positions = _ranges([b.start for _, b in blocks], [b.end for _, b in blocks])
        current = torch.cat([p.req.tokens[b.start:b.end] for p, b in blocks])
        params = [r.params for r in reqs]
        keys = row_keys(_repeat([r.seed for r in reqs], lengths, torch.int64), positions,
                        _repeat([r.nfe for r in reqs], lengths, torch.int64))
        logits = self.model.compute_logits(hidden)
        dev = logits.device
        result = sample_reference(
            logits,
            temperature=_repeat([q.temperature for q in params], lengths, torch.float32).to(dev),
            keys=keys.to(dev),
            confidence_kind=_repeat([int(q.confidence_kind) for q in params], lengths, torch.int64).to(dev),
            top_k=_repeat([q.top_k for q in params], lengths, torch.int64).to(dev),
            top_p=_repeat([q.top_p for q in params], lengths, torch.float32).to(dev),
        )
        current_dev = current.to(dev)
        current_prob = torch.exp(logits.to(result.logsumexp.dtype).gather(1, current_dev[:, None]).squeeze(1) - result.logsumexp)
        batch = AcceptanceBatch(
            current=current_dev,
            predicted=result.tokens,
            confidence=result.confidence,
            current_prob=current_prob,
            segment=_repeat(list(range(len(blocks))), lengths, torch.int64).to(dev),
            seg_first=torch.tensor([b.is_first for _, b in blocks], device=dev),
            seg_enabled=torch.tensor([b.enabled for _, b in blocks], device=dev),
            seg_accept_threshold=torch.tensor([r.accept_threshold for r in reqs], dtype=torch.float32, device=dev),
            seg_remask_threshold=torch.tensor([r.remask_threshold for r in reqs], dtype=torch.float32, device=dev),
            seg_num_transfer=torch.tensor([b.num_transfer for _, b in blocks], dtype=torch.int64, device=dev),
        )
        return self.sampler(batch).cpu()
