"""CUDA graphs for decode steps: the model forward captured once per bucket, then replayed over static inputs.

A bucket is (padded tokens, padded sequences, bound on tokens per sequence). A batch is padded to the
bucket's sizes:
  * token rows past the real ones belong to no sequence and have slot -1, so their K/V are never stored;
  * sequences past the real ones are empty: cu_seqlens_q repeats the total, context length 0;
  * page tables are -1 past each sequence's pages.
build_forward_batch already writes it so, into one flat host buffer laid out for its bucket (FlatLayout); a
replay copies that buffer as it is into one static device buffer, of which the bucket's inputs are views.
The Triton kernels, and flash-attn's paged kernel where it takes a wide group's context, read lengths, pages and
slots from those device buffers and size their grids from the bucket's host bounds (its tokens per sequence, and
max_model_len for the context), so one graph serves every batch that fits its bucket. Padded rows compute values that no real row reads: outside attention every op of
the forward is row by row. Graphs are captured on first use, on one stream, into one memory pool. Graphs
share their temporaries' blocks, since one replays at a time, and each keeps its output's; a replay overwrites its
output, so a row kept across steps is cloned out of it (runner.py).

With LoRA adapters attached, a step with adapter rows replays a second graph of its bucket, whose forward adds
each adapted projection's delta (layers/fused_forward.py). It reads the step's adapter segments from one more
static device buffer, a table of one row per sequence of the bucket: lora_batch gives each sequence with an
adapter a segment of its own, so a bucket's sequences bound the segments and its tokens per sequence bound their
rows; rows past the real segments are empty segments, which the kernels skip. A step without adapter rows replays
the graph without the delta, the one a model without adapters replays.

A model whose forward takes inputs of its own per row (DiffusionGemma: which rows are canvas rows, and their
self-conditioning embeddings) names them (`model.row_inputs()`); each has a static buffer of the bucket's rows, and
rows past the real ones are zero. A runner that changes the batch's token ids on the device after building it (a canvas's
random start) passes them to `run`, which writes them over the static buffer's.

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
from .layers.lora import LoraBatch, LoraSegments, segment_table
from .lora import has_adapters
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
        # The model's own inputs per row, by keyword; a batch's rows first, then zeros.
        self.static_rows = {name: torch.zeros((self.max_tokens, *spec.shape), dtype=spec.dtype, device=device)
                            for name, spec in model.row_inputs().items()}
        # Adapter segments (slot, first row, end row) of a LoRA step, a row per sequence; None without adapters.
        self.static_lora = (torch.zeros((self.max_seqs, 3), dtype=torch.int64, device=device)
                            if has_adapters(model) else None)

    def bucket_for(self, batch: ForwardBatch, lora: LoraBatch | None = None) -> GraphBucket | None:
        """The bucket the batch pads into, or None when it fits none (it then runs eagerly)."""
        if (batch.num_tokens > self.max_tokens or batch.num_seqs > self.max_seqs
                or batch.max_seqlen_q > self.max_seqlen_q or batch.layout.num_page_columns > self.num_page_columns):
            return None
        bucket = GraphBucket(round_up_tokens(batch.num_tokens), round_up_seqs(batch.num_seqs),
                             next_power_of_2(batch.max_seqlen_q))
        if lora is not None and (self.static_lora is None or len(lora.segments) > bucket.num_seqs
                                 or lora.max_rows > bucket.max_seqlen_q):
            return None  # segments that are not one per sequence: the LoRA graph's kernels are not sized for them
        return bucket

    def run(self, bucket: GraphBucket, batch: ForwardBatch, lora: LoraBatch | None = None,
            input_ids: torch.Tensor | None = None,  # [T] on the device: the batch's ids as the runner changed them
            rows: dict[str, torch.Tensor] | None = None,  # row_inputs' values of the T real rows, on the device
            ) -> torch.Tensor:  # [T, hidden] of the real rows
        layout = flat_layout(bucket.num_tokens, bucket.num_seqs, self.num_page_columns)
        # One copy for all seven inputs, from the batch's own (pinned) buffer unless a test asks for another bucket.
        self.static[: layout.size].copy_(batch.padded_flat(layout), non_blocking=True)
        real = batch.num_tokens
        if input_ids is not None:
            self._static_batch(bucket).input_ids[:real].copy_(input_ids)
        if set(rows or {}) != set(self.static_rows):
            raise ValueError(f"PaddedForward.run: row inputs {sorted(rows or {})}, expected {sorted(self.static_rows)}")
        for name, static in self.static_rows.items():
            static[:real].copy_(rows[name])
            static[real:bucket.num_tokens].zero_()
        if lora is not None:
            table = segment_table(lora, bucket.num_seqs, pin_memory=self.device.type == "cuda")
            self.static_lora[: bucket.num_seqs].copy_(table, non_blocking=True)
        if self.merge is not None:
            n = bucket.num_tokens
            if batch.soft_ids is None:
                self.static_soft_coef[:n].zero_()
            else:
                ids, coef = batch.padded_soft(n)
                self.static_soft_ids[:n].copy_(ids, non_blocking=True)
                self.static_soft_coef[:n].copy_(coef, non_blocking=True)
        return self._forward(bucket, batch, lora is not None)[: batch.num_tokens]

    def _static_lora(self, bucket: GraphBucket) -> LoraSegments:
        return LoraSegments(self.static_lora[: bucket.num_seqs], bucket.max_seqlen_q)

    def _static_soft(self, bucket: GraphBucket) -> SoftInputs | None:
        if self.merge is None:
            return None
        n = bucket.num_tokens
        return SoftInputs(self.static_soft_ids[:n], self.static_soft_coef[:n], self.merge)

    def _static_batch(self, bucket: GraphBucket) -> ForwardBatch:
        """The bucket's inputs, as views of the static buffer."""
        layout = flat_layout(bucket.num_tokens, bucket.num_seqs, self.num_page_columns)
        return ForwardBatch(self.static, layout, bucket.num_tokens, bucket.num_seqs, bucket.max_seqlen_q,
                            self.max_context_len)

    def _static_inputs(self, bucket: GraphBucket,
                       batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        static = self._static_batch(bucket)
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

    def _static_rows(self, bucket: GraphBucket) -> dict[str, torch.Tensor]:
        return {name: static[: bucket.num_tokens] for name, static in self.static_rows.items()}

    def _forward(self, bucket: GraphBucket, batch: ForwardBatch,
                 with_lora: bool = False) -> torch.Tensor:  # [bucket tokens, hidden]
        input_ids, positions, meta = self._static_inputs(bucket, batch)
        return self._model_forward(input_ids, positions, meta, self._static_soft(bucket),
                                   self._static_lora(bucket) if with_lora else None, self._static_rows(bucket))

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       soft: SoftInputs | None, lora: LoraSegments | None,
                       rows: dict[str, torch.Tensor]) -> torch.Tensor:
        if lora is not None and self.model.fused_kernels:
            # DecoderLM.forward sends a forward with adapters to the torch modules; the fused one adds the delta.
            from .layers.fused_forward import fused_forward  # imports Triton: only with the kernels

            return fused_forward(self.model, input_ids, positions, meta, self.kv_cache, soft, lora)
        return self.model(input_ids, positions, meta, self.kv_cache, soft, lora=lora, **rows)


class CUDAGraphForward(PaddedForward):
    """Captures the padded forward per bucket on first use and replays it. Needs the Triton attention (with
    flash-attn's paged kernel or without), which reads only device metadata; the torch attention loops over host
    lengths that a graph would freeze."""

    def __init__(self, model, kv_cache: torch.Tensor, config: Config, device: torch.device,
                 merge: TokenMerge | None = None):
        super().__init__(model, kv_cache, config, device, merge)
        # By (bucket, with the LoRA delta): a bucket has a second graph once a step with adapter rows used it.
        self.graphs: dict[tuple[GraphBucket, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # Every capture, and the eager run before it, on this one stream: PyTorch keeps a cuBLAS workspace for each
        # stream cuBLAS has run on, for as long as the process lives (32 MiB on Hopper). The KV cache's sizing
        # counts one, its trial capture's, which stays reserved beside this one. A fresh stream for each eager run
        # held one more each, up to the 32 streams PyTorch hands out in turn.
        self.capture_stream = torch.cuda.Stream(device)

    def capture_largest(self) -> None:
        """Captures the graph of the largest bucket a step can pad into, over the static buffers as they are: the
        graph whose temporaries the pool must hold, smaller graphs' fitting in the blocks it frees. The KV cache's
        sizing measures what this takes (model_setup.num_kv_pages), over a cache of its own."""
        bucket = GraphBucket(self.max_tokens, self.max_seqs, self.max_seqlen_q)
        self.graphs[(bucket, False)] = self._capture(bucket, self._static_batch(bucket), False)

    def _forward(self, bucket: GraphBucket, batch: ForwardBatch, with_lora: bool = False) -> torch.Tensor:
        key = (bucket, with_lora)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, batch, with_lora)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden

    def _capture(self, bucket: GraphBucket, batch: ForwardBatch,
                 with_lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        input_ids, positions, meta = self._static_inputs(bucket, batch)
        soft = self._static_soft(bucket)
        lora = self._static_lora(bucket) if with_lora else None
        rows = self._static_rows(bucket)
        # One eager run on the capture stream first, as capture requires: Triton compiles its kernels and cuBLAS
        # sets up the stream's workspace outside the graph. It stores the same K/V the replay stores again.
        # The eager steps' cached blocks go back first: the capture releases them anyway, and a capture met while
        # serving would otherwise peak with them, the eager run's and the full pool at once.
        main = torch.cuda.current_stream(self.device)
        main.synchronize()
        torch.cuda.empty_cache()
        self.capture_stream.wait_stream(main)
        with torch.cuda.stream(self.capture_stream):
            self._model_forward(input_ids, positions, meta, soft, lora, rows)
        main.wait_stream(self.capture_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            hidden = self._model_forward(input_ids, positions, meta, soft, lora, rows)
        return graph, hidden
