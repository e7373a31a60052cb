"""CUDA graphs for decode steps: the model forward captured once per bucket, then replayed over static inputs.

A bucket is (padded tokens, padded sequences, bound on tokens per sequence). A batch is padded to the
bucket's sizes:
  * token rows past the real ones belong to no sequence and have slot -1, so their K/V are never stored;
  * sequences past the real ones are empty: cu_seqlens_q repeats the total, context length 0;
  * page tables are -1 past each sequence's pages.
build_forward_batch already writes it so, into one flat host buffer laid out for its bucket (FlatLayout); a
replay copies that buffer as it is into one static device buffer, of which the bucket's inputs are views.
The Triton kernels read lengths, pages and slots from those device buffers and size their grids from the
bucket's host bounds (its tokens per sequence, and max_model_len for the context), so one graph serves every
batch that fits its bucket. Padded rows compute values that no real row reads: outside attention every op of
the forward is row by row. Graphs are captured on first use, into one memory pool.

Steps that fit no bucket (prefill chunks, whole-sequence strategies) run eagerly. `PaddedForward` runs the
padded forward eagerly too, on any device: it is how the padding is checked against the unpadded batch on the
CPU torch path. `CUDAGraphForward` captures and replays it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .config import Config
from .forward_batch import ForwardBatch, flat_layout, round_up_seqs, round_up_tokens
from .models.decoder_lm import SoftInputs, TokenMerge


@dataclass(frozen=True)
class GraphBucket:
    num_tokens: int
    num_seqs: int
    max_seqlen_q: int  # upper bound of any sequence's tokens: it sizes the attention grid


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PaddedForward:
    """The model forward over a batch padded into static buffers, run eagerly."""

    def __init__(self, model, kv_cache: torch.Tensor, config: Config, device: torch.device,
                 merge: TokenMerge | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # The largest decode feed of one sequence: blocks committed in the last step plus the blocks in flight.
        self.max_seqlen_q = next_power_of_2(2 * config.buffer_size * config.block_size)
        self.max_seqs = round_up_seqs(config.max_num_reqs)
        self.max_tokens = round_up_tokens(min(config.max_num_batched_tokens, config.max_num_reqs * self.max_seqlen_q))
        self.max_context_len = config.max_model_len
        self.num_page_columns = -(-config.max_model_len // config.page_size)
        # Every bucket's inputs are views into this one buffer, laid out for that bucket (FlatLayout).
        self.static = torch.zeros(flat_layout(self.max_tokens, self.max_seqs, self.num_page_columns).size,
                                  dtype=torch.int64, device=device)
        # Soft inputs (dmax): every forward of such an engine takes them, so a graph computes the mixture
        # (decoder_lm.soft_embeddings) from these two buffers; a batch without soft rows fills weights of 0.
        self.merge = merge
        if merge is not None:
            self.static_soft_ids = torch.zeros((self.max_tokens, merge.top_k), dtype=torch.int64, device=device)
            self.static_soft_coef = torch.zeros((self.max_tokens, merge.top_k + 1), dtype=torch.float32, device=device)

    def bucket_for(self, batch: ForwardBatch) -> GraphBucket | None:
        """The bucket the batch pads into, or None when it fits none (it then runs eagerly)."""
        if (batch.num_tokens > self.max_tokens or batch.num_seqs > self.max_seqs
                or batch.max_seqlen_q > self.max_seqlen_q or batch.layout.num_page_columns > self.num_page_columns):
            return None
        return GraphBucket(round_up_tokens(batch.num_tokens), round_up_seqs(batch.num_seqs),
                           next_power_of_2(batch.max_seqlen_q))

    def run(self, bucket: GraphBucket, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden] of the real rows
        layout = flat_layout(bucket.num_tokens, bucket.num_seqs, self.num_page_columns)
        # One copy for all seven inputs, from the batch's own (pinned) buffer unless a test asks for another bucket.
        self.static[: layout.size].copy_(batch.padded_flat(layout), non_blocking=True)
        if self.merge is not None:
            n = bucket.num_tokens
            if batch.soft_ids is None:
                self.static_soft_coef[:n].zero_()
            else:
                ids, coef = batch.padded_soft(n)
                self.static_soft_ids[:n].copy_(ids, non_blocking=True)
                self.static_soft_coef[:n].copy_(coef, non_blocking=True)
        return self._forward(bucket, batch)[: batch.num_tokens]

    def _static_soft(self, bucket: GraphBucket) -> SoftInputs | None:
        if self.merge is None:
            return None
        n = bucket.num_tokens
        return SoftInputs(self.static_soft_ids[:n], self.static_soft_coef[:n], self.merge)

    def _static_inputs(self, bucket: GraphBucket,
                       batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        layout = flat_layout(bucket.num_tokens, bucket.num_seqs, self.num_page_columns)
        static = ForwardBatch(self.static, layout, bucket.num_tokens, bucket.num_seqs, bucket.max_seqlen_q,
                              self.max_context_len)
        empty_seqs = bucket.num_seqs - batch.num_seqs
        meta = AttentionMetadata(
            cu_seqlens_q=static.cu_seqlens_q, context_lens=static.context_lens, page_tables=static.page_tables,
            slot_mapping=static.slot_mapping, block_ids=static.block_ids, max_seqlen_q=bucket.max_seqlen_q,
            max_context_len=self.max_context_len,
            # Read by the torch attention only, which the CUDA graphs never capture.
            cu_seqlens_q_host=tuple(batch.cu_seqlens_q.tolist() + [batch.num_tokens] * empty_seqs),
            context_lens_host=tuple(batch.context_lens.tolist() + [0] * empty_seqs),
        )
        return static.input_ids, static.positions, meta

    def _forward(self, bucket: GraphBucket, batch: ForwardBatch) -> torch.Tensor:  # [bucket tokens, hidden]
        input_ids, positions, meta = self._static_inputs(bucket, batch)
        return self.model(input_ids, positions, meta, self.kv_cache, self._static_soft(bucket))


class CUDAGraphForward(PaddedForward):
    """Captures the padded forward per bucket on first use and replays it. Needs the Triton attention, which
    reads only device metadata; the torch attention loops over host lengths that a graph would freeze."""

    def __init__(self, model, kv_cache: torch.Tensor, config: Config, device: torch.device,
                 merge: TokenMerge | None = None):
        super().__init__(model, kv_cache, config, device, merge)
        self.graphs: dict[GraphBucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _forward(self, bucket: GraphBucket, batch: ForwardBatch) -> torch.Tensor:
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket, batch)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden

    def _capture(self, bucket: GraphBucket, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        input_ids, positions, meta = self._static_inputs(bucket, batch)
        soft = self._static_soft(bucket)
        # One eager run on a side stream first, as capture requires: Triton compiles its kernels and cuBLAS
        # sets up its workspaces outside the graph. It stores the same K/V the replay stores again.
        main = torch.cuda.current_stream(self.device)
        warmup = torch.cuda.Stream(self.device)
        warmup.wait_stream(main)
        with torch.cuda.stream(warmup):
            self.model(input_ids, positions, meta, self.kv_cache, soft)
        main.wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(input_ids, positions, meta, self.kv_cache, soft)
        return graph, hidden
