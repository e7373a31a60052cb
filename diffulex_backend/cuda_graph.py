"""CUDA graphs for decode steps: the model forward captured once per bucket, then replayed over static inputs.

A bucket is (padded tokens, padded sequences, bound on tokens per sequence). A batch is padded into the
bucket's static device buffers:
  * token rows past the real ones belong to no sequence and have slot -1, so their K/V are never stored;
  * sequences past the real ones are empty: cu_seqlens_q repeats the total, context length 0;
  * page tables are -1 past each sequence's pages.
The Triton kernels read lengths, pages and slots from those device buffers and size their grids from the
bucket's host bounds (its tokens per sequence, and max_model_len for the context), so one graph serves every
batch that fits its bucket. Padded rows compute values that no real row reads: outside attention every op of
the forward is row by row. Graphs are captured on first use, into one memory pool.

Steps that fit no bucket (prefill chunks, whole-sequence strategies) run eagerly. `PaddedForward` runs the
padded forward eagerly too, on any device: it is how the padding is checked against the unpadded batch on the
CPU torch path. `CUDAGraphForward` captures and replays it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .config import Config
from .forward_batch import ForwardBatch


@dataclass(frozen=True)
class GraphBucket:
    num_tokens: int
    num_seqs: int
    max_seqlen_q: int  # upper bound of any sequence's tokens: it sizes the attention grid


def round_up_tokens(n: int) -> int:
    """Multiples of 32 up to 512, then 16 sizes per octave: padding stays under 1/16 of the forward."""
    step = max(32, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step


def round_up_seqs(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8 (empty sequences cost the attention grid almost nothing)."""
    return 1 << max(0, (n - 1).bit_length()) if n <= 8 else -(-n // 8) * 8


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pad_batch(batch: ForwardBatch, bucket: GraphBucket, num_page_columns: int, max_context_len: int,
              pin_memory: bool = False) -> ForwardBatch:
    """The batch padded to the bucket's sizes, on the host (see the module docstring)."""

    def padded(values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
        out = torch.full((size,), fill, dtype=values.dtype, pin_memory=pin_memory)
        out[: values.numel()] = values
        return out

    tokens, seqs = bucket.num_tokens, bucket.num_seqs
    page_tables = torch.full((seqs, num_page_columns), -1, dtype=torch.int32, pin_memory=pin_memory)
    page_tables[: batch.num_seqs, : batch.page_tables.shape[1]] = batch.page_tables
    return ForwardBatch(
        input_ids=padded(batch.input_ids, tokens, 0),
        positions=padded(batch.positions, tokens, 0),
        slot_mapping=padded(batch.slot_mapping, tokens, -1),
        block_ids=padded(batch.block_ids, tokens, 0),
        cu_seqlens_q=padded(batch.cu_seqlens_q, seqs + 1, batch.num_tokens),
        context_lens=padded(batch.context_lens, seqs, 0),
        page_tables=page_tables,
        max_seqlen_q=bucket.max_seqlen_q,
        max_context_len=max_context_len,
    )


class PaddedForward:
    """The model forward over a batch padded into static buffers, run eagerly."""

    def __init__(self, model, kv_cache: torch.Tensor, config: Config, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # The largest decode feed of one sequence: blocks committed in the last step plus the blocks in flight.
        self.max_seqlen_q = next_power_of_2(2 * config.buffer_size * config.block_size)
        self.max_seqs = round_up_seqs(config.max_num_reqs)
        self.max_tokens = round_up_tokens(min(config.max_num_batched_tokens, config.max_num_reqs * self.max_seqlen_q))
        self.max_context_len = config.max_model_len
        self.num_page_columns = -(-config.max_model_len // config.page_size)
        self.static = ForwardBatch(  # the device buffers every bucket's inputs are views of
            input_ids=torch.zeros(self.max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(self.max_tokens, dtype=torch.int64, device=device),
            slot_mapping=torch.full((self.max_tokens,), -1, dtype=torch.int64, device=device),
            block_ids=torch.zeros(self.max_tokens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device),
            context_lens=torch.zeros(self.max_seqs, dtype=torch.int32, device=device),
            page_tables=torch.full((self.max_seqs, self.num_page_columns), -1, dtype=torch.int32, device=device),
            max_seqlen_q=self.max_seqlen_q,
            max_context_len=self.max_context_len,
        )

    def bucket_for(self, batch: ForwardBatch) -> GraphBucket | None:
        """The bucket the batch pads into, or None when it fits none (it then runs eagerly)."""
        if (batch.num_tokens > self.max_tokens or batch.num_seqs > self.max_seqs
                or batch.max_seqlen_q > self.max_seqlen_q or batch.page_tables.shape[1] > self.num_page_columns):
            return None
        return GraphBucket(round_up_tokens(batch.num_tokens), round_up_seqs(batch.num_seqs),
                           next_power_of_2(batch.max_seqlen_q))

    def run(self, bucket: GraphBucket, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden] of the real rows
        padded = pad_batch(batch, bucket, self.num_page_columns, self.max_context_len,
                           pin_memory=self.device.type == "cuda")
        for field in dataclasses.fields(ForwardBatch):
            source = getattr(padded, field.name)
            if isinstance(source, torch.Tensor):
                getattr(self.static, field.name)[: source.shape[0]].copy_(source, non_blocking=True)
        return self._forward(bucket, padded)[: batch.num_tokens]

    def _static_inputs(self, bucket: GraphBucket,
                       padded: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        static, tokens, seqs = self.static, bucket.num_tokens, bucket.num_seqs
        meta = AttentionMetadata(
            cu_seqlens_q=static.cu_seqlens_q[: seqs + 1], context_lens=static.context_lens[:seqs],
            page_tables=static.page_tables[:seqs], slot_mapping=static.slot_mapping[:tokens],
            block_ids=static.block_ids[:tokens], max_seqlen_q=bucket.max_seqlen_q,
            max_context_len=self.max_context_len,
            # Read by the torch attention only, which the CUDA graphs never capture.
            cu_seqlens_q_host=tuple(padded.cu_seqlens_q.tolist()),
            context_lens_host=tuple(padded.context_lens.tolist()),
        )
        return static.input_ids[:tokens], static.positions[:tokens], meta

    def _forward(self, bucket: GraphBucket, padded: ForwardBatch) -> torch.Tensor:  # [bucket tokens, hidden]
        input_ids, positions, meta = self._static_inputs(bucket, padded)
        return self.model(input_ids, positions, meta, self.kv_cache)


class CUDAGraphForward(PaddedForward):
    """Captures the padded forward per bucket on first use and replays it. Needs the Triton attention, which
    reads only device metadata; the torch attention loops over host lengths that a graph would freeze."""

    def __init__(self, model, kv_cache: torch.Tensor, config: Config, device: torch.device):
        super().__init__(model, kv_cache, config, device)
        self.graphs: dict[GraphBucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _forward(self, bucket: GraphBucket, padded: ForwardBatch) -> torch.Tensor:
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket, padded)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden

    def _capture(self, bucket: GraphBucket, padded: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        input_ids, positions, meta = self._static_inputs(bucket, padded)
        # One eager run on a side stream first, as capture requires: Triton compiles its kernels and cuBLAS
        # sets up its workspaces outside the graph. It stores the same K/V the replay stores again.
        main = torch.cuda.current_stream(self.device)
        warmup = torch.cuda.Stream(self.device)
        warmup.wait_stream(main)
        with torch.cuda.stream(warmup):
            self.model(input_ids, positions, meta, self.kv_cache)
        main.wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(input_ids, positions, meta, self.kv_cache)
        return graph, hidden
