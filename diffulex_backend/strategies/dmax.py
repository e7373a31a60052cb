"""`dmax`: DMax's soft parallel decoding (Chen et al., 2026, "DMax: Aggressive Parallel Decoding for dLLMs") on
top of block diffusion with several blocks in flight (block_diffusion.py: the same blocks, joining, acceptance
of masked positions and commit of the first block).

What it adds, following the authors' decoder (czg1225/DMax, dInfer `decode_uniform`) and Diffulex's token merge:
- Soft inputs. Every step records, for each predicted position, the top-k (`token_merge_top_k`) tokens of its
  distribution and their probabilities p_k. Next step, a decoded position of an uncommitted block is fed not as
  its token's embedding e but as a mixture (models/decoder_lm.py `soft_embeddings`):
      x = sum_k p_k e_k + r m,  r = max(0, 1 - sum_k p_k),  m = the mask token's embedding,
  rescaled when `token_merge_renormalize` to the norm sum_k p_k |e_k| + r |m|, and fed as e + w (x - e) with
  w = `token_merge_weight` (w = 1 is DMax's input; w = 0 feeds the token: plain block diffusion). The probabilities
  are the raw ones, not renormalised over the top k: what the top k leave goes to the mask embedding. Masked
  positions stay the mask embedding, committed ones their token's, so the cache holds hard K/V only.
  `token_merge_mode` "iter_smooth_topk" feeds e + w sum_k p_k e_k instead (Diffulex's second mode).
- Editing (`edit_threshold` > 0). A decoded position of an accepting block in flight takes the new prediction at
  every step (DMax's self-revision); remasked positions stay masked. A full first block commits only once it is
  stable: the last step gave every position a top-1 probability >= edit_threshold, or changed none of its
  tokens (DMax's two stopping rules; its threshold is the 0.9 of the reference code). Decoding must end, so a
  full block that has not settled after block_size further steps commits as it is (Diffulex caps the same loop
  with max_post_edit_steps). edit_threshold 0 turns editing off: decoded tokens are final, as in multi_bd.
Deviation: masked positions are accepted by the engine's acceptance rule (every position whose confidence clears
the threshold, at least one in the first block), not only the leading run of confident ones as in the reference.
On CUDA the mixture is computed inside the decode graphs from two static buffers (cuda_graph.py).
"""
from __future__ import annotations

import numpy as np
import torch

from ..acceptance import AcceptanceBatch, AcceptanceRule
from ..config import Config
from ..sampling import SamplingMode
from ..kv_cache import KVCacheManager
from ..models.decoder_lm import TokenMerge
from ..plan import LogitBlock, SeqPlan
from ..registry import Strategy, register_strategy
from ..runner import ModelRunner, Predictions
from ..sampling import Confidence
from ..scheduler import Scheduler
from .block_diffusion import BLOCK_THRESHOLDS, BlockDiffusionRequest, validate_multi_bd


class DMaxRequest(BlockDiffusionRequest):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.config.token_merge_top_k
        # The last prediction of each generated position: top-k tokens and probabilities (0: never predicted).
        self.pred_ids = np.zeros((self.params.max_tokens, k), dtype=np.int64)
        self.pred_probs = np.zeros((self.params.max_tokens, k), dtype=np.float32)
        self.last_plan: SeqPlan | None = None  # what the last forward fed: the tokens before its step
        self.steps_full = 0  # steps the first block in flight has been full without settling

    def make_plan(self, start: int, end: int, context_len: int, cache_index: np.ndarray, block_ids: np.ndarray,
                  blocks: list[LogitBlock]) -> SeqPlan:
        plan = super().make_plan(start, end, context_len, cache_index, block_ids, blocks)
        k = self.config.token_merge_top_k
        ids = np.zeros((end - start, k), dtype=np.int64)
        coef = np.zeros((end - start, k + 1), dtype=np.float32)
        lo = max(start, self.committed_end)  # uncommitted positions: the only ones fed soft
        if lo < end:
            rows, gen = slice(lo - start, end - start), slice(lo - self.gen_start, end - self.gen_start)
            ids[rows] = self.pred_ids[gen]
            coef[rows, :k] = self.pred_probs[gen]
            decoded = (self.tokens[lo:end] != self.mask_token_id) & (self.pred_probs[gen, 0] > 0)
            coef[rows, k] = np.where(decoded, np.float32(self.config.token_merge_weight), np.float32(0))
        plan.soft_ids, plan.soft_coef = ids, coef
        return plan

    def after_forward(self, plan: SeqPlan) -> None:
        super().after_forward(plan)
        self.last_plan = plan

    def record_predictions(self, start: int, end: int, predictions: Predictions, at: int) -> None:
        """Keep the step's top-k of positions [start, end), rows [at, ...) of `predictions`."""
        gen = slice(start - self.gen_start, end - self.gen_start)
        self.pred_ids[gen] = predictions.ids[at:at + end - start].numpy()
        self.pred_probs[gen] = predictions.probs[at:at + end - start].numpy()

    def commit_ready_blocks(self) -> int:
        first = self.num_committed_blocks
        if first < self.num_joined_blocks and self._is_full(first):
            self.steps_full += 1
        limit = first
        while limit < self.num_joined_blocks and self._is_full(limit) and self._is_stable(limit):
            limit += 1
        committed = self.commit_filled_blocks(limit)
        if committed:
            self.steps_full = 0
        self._join_blocks()
        return committed

    def _is_full(self, k: int) -> bool:
        start, end = self.block_span(k)
        return not bool((self.tokens[start:end] == self.mask_token_id).any())

    def _is_stable(self, k: int) -> bool:
        """Full block k may commit: always without editing; with it, once the last step left it settled."""
        threshold = self.sampling.edit_threshold
        if threshold == 0:
            return True
        if k == self.num_committed_blocks and self.steps_full > self.config.block_size:
            return True  # decoding must end: the block stopped settling
        start, end = self.block_span(k)
        if bool((self.pred_probs[start - self.gen_start:end - self.gen_start, 0] >= threshold).all()):
            return True
        plan = self.last_plan
        fed = plan is not None and plan.start <= start and end <= plan.end
        return fed and bool((self.tokens[start:end] == plan.token_ids[start - plan.start:end - plan.start]).all())


class DMaxRunner(ModelRunner):
    """Feeds soft inputs and returns each step's top-k; applies the edits after the acceptance rule."""

    @staticmethod
    def token_merge_for(config: Config) -> TokenMerge:
        return TokenMerge(config.mask_token_id, config.token_merge_mode, config.token_merge_renormalize,
                          config.token_merge_top_k)

    def accept(self, batch: AcceptanceBatch, logits: torch.Tensor, blocks: list[tuple[SeqPlan, LogitBlock]]
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        tokens = self.acceptance(batch, use_kernel=self.use_kernels)  # [A]
        k = self.token_merge.top_k
        if k == 1 and all(p.sampling.temperature == 0 and p.sampling.confidence_kind == Confidence.PROB
                          for p, _ in blocks):
            # A greedy row's token is its top-1 and a prob confidence that token's probability: the sampler has
            # already found both, so no pass over the logits is made again.
            top_ids, top_probs = batch.predicted[:, None], batch.confidence[:, None]
        else:
            # One reduction for K = 1; topk's radix select takes several passes over the logits.
            top_logits, top_ids = logits.max(dim=-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1)  # [A, K]
            top_probs = torch.exp(top_logits.to(batch.logsumexp.dtype) - batch.logsumexp[:, None])
        editing = [p.sampling.edit_threshold > 0 for p, _ in blocks]
        if any(editing):
            mask = self.acceptance.mask_token_id
            # Pinned and non-blocking: a copy from pageable memory would wait here for the whole forward.
            editing = torch.tensor(editing, pin_memory=self.pin_memory).to(tokens.device, non_blocking=True)
            seg_edit = editing & batch.seg_enabled  # [S]
            seg = torch.repeat_interleave(torch.arange(seg_edit.numel(), device=tokens.device),
                                          batch.seg_offsets.diff(), output_size=tokens.numel())
            edit = seg_edit[seg] & (batch.current != mask) & (tokens != mask)
            tokens = torch.where(edit, batch.predicted, tokens)
        return tokens, (top_ids, top_probs)


register_strategy(Strategy(
    name="dmax", request_cls=DMaxRequest, scheduler_cls=Scheduler, kv_cache_cls=KVCacheManager,
    runner_cls=DMaxRunner, acceptance_cls=AcceptanceRule, default_sampling_mode=SamplingMode.THRESHOLD,
    supports_prefix_caching=True, validate=validate_multi_bd, aliases=("soft_parallel",),
    options=BLOCK_THRESHOLDS | {"token_merge_mode", "token_merge_top_k", "token_merge_renormalize", "token_merge_weight",
                                "edit_threshold"},
))
