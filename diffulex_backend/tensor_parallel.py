"""Which share of the model one rank holds, and the collectives that put the shares together.

Megatron-style splits, the ones vLLM uses:
- q/k/v and gate/up are column-parallel (each rank holds some heads, some intermediate columns), o_proj and
  down_proj row-parallel, with one all-reduce after each;
- KV heads are split across ranks, or, with fewer KV heads than ranks, each rank holds the one its query heads
  read (replicated);
- the embedding and the output head are split by vocabulary rows (padded to a multiple of the ranks): a lookup is
  an all-reduce of the rows each rank holds; a greedy step samples from each rank's share of the logits, trading
  a few numbers a row (sampling.greedy_over_shards), and other steps gather the whole rows;
- a MoE layer's experts are split by their intermediate dimension, or with `expert_parallel` whole experts per
  rank; either way the layer's output is one all-reduce of the partial sums, since every rank holds every token.

The process group is an object held here and passed down with the model, not torch.distributed's default group:
two engines in one process (tests, benchmarks) never share state. Collectives call the group directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .arch import ModelArch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE layers: whole experts per rank instead of a share of each
    group: Any = None  # a torch.distributed ProcessGroup (gloo or NCCL); None with one rank
    peer: Any = None  # a peer_memory.PeerCollectives where the ranks' GPUs reach each other's memory

    def share(self, total: int) -> slice:
        """This rank's contiguous share of `total` items (heads, columns, experts); `total` divides evenly."""
        size = total // self.size
        return slice(self.rank * size, (self.rank + 1) * size)

    def kv_heads(self, arch: ModelArch) -> slice:
        """The KV heads this rank's query heads read: a share of them, or one (replicated) when ranks outnumber
        them."""
        if arch.num_kv_heads >= self.size:
            return self.share(arch.num_kv_heads)
        head = self.rank * arch.num_kv_heads // self.size
        return slice(head, head + 1)

    def vocab_rows(self, vocab_size: int) -> slice:
        """This rank's rows of the embedding and the head; the last rank's share may run past the vocabulary
        (padding rows that no id reaches)."""
        size = -(-vocab_size // self.size)
        return slice(self.rank * size, (self.rank + 1) * size)

    def experts(self, num_experts: int) -> slice:
        """The routed experts this rank holds: all of them, or a share with expert parallelism."""
        return self.share(num_experts) if self.expert_parallel else slice(0, num_experts)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`. A no-op with one rank. Small sums go over peer memory when
        the ranks have it: every rank takes the same way, since every rank sums the same shapes."""
        if self.size > 1:
            if self.peer is not None and self.peer.fits(tensor, summed=True):
                return self.peer.all_reduce(tensor)
            self.group.allreduce([tensor]).wait()
        return tensor

    def sum_partials(self, partials: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's split sums [S, *shape] summed over S and over the ranks: [*shape] in their
        dtype. Over peer memory one launch does both sums; through NCCL torch adds the splits first."""
        if partials.shape[0] == 1:
            return self.all_reduce(partials[0].contiguous())
        if self.size > 1 and self.peer is not None and partials.is_contiguous() and self.peer.fits(partials[0],
                                                                                                    summed=True):
            return self.peer.sum_partials(partials)
        return self.all_reduce(partials.sum(0))

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over ranks, in place; returns `tensor`. A no-op with one rank."""
        if self.size > 1:
            options = torch.distributed.AllreduceOptions()
            options.reduceOp = torch.distributed.ReduceOp.MAX
            self.group.allreduce([tensor], options).wait()
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[size, *shape]: every rank's `tensor` (same shape on each), rank 0's first, in one collective into one
        buffer: over peer memory when it fits, as all_reduce."""
        if self.size == 1:
            return tensor[None]
        tensor = tensor.contiguous()
        if self.peer is not None and self.peer.fits(tensor, summed=False):
            return self.peer.gather(tensor)
        out = torch.empty((self.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        self.group._allgather_base(out, tensor).wait()
        return out.view(self.size, *tensor.shape)

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C], rank 0's columns first."""
        return tensor if self.size == 1 else torch.cat(self.gather(tensor).unbind(0), dim=1)


def check_shardable(arch: ModelArch, tp: TensorParallel) -> None:
    """Raises ValueError naming the config field when the model cannot be split `tp.size` ways."""
    n = tp.size
    if n == 1:
        return

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"config field 'tensor_parallel_size' is {n}, but {what}")

    need(arch.num_heads % n == 0, f"the model's {arch.num_heads} attention heads do not split {n} ways")
    last_rank_start = TensorParallel(n - 1, n).vocab_rows(arch.vocab_size).start
    need(arch.vocab_size >= 2 * n and last_rank_start < arch.vocab_size,
         f"the model's vocabulary of {arch.vocab_size} leaves a rank fewer than 2 tokens of it")
    kv = arch.num_kv_heads
    need(kv % n == 0 or n % kv == 0, f"the model's {kv} KV heads neither split {n} ways nor divide {n}")
    if arch.num_moe_layers < arch.num_layers:
        need(arch.intermediate_size % n == 0,
             f"the dense MLP's intermediate size {arch.intermediate_size} does not split {n} ways")
    if arch.num_experts:
        if tp.expert_parallel:
            need(arch.num_experts % n == 0, f"the model's {arch.num_experts} experts do not split {n} ways "
                                            f"(expert_parallel)")
        else:
            need(arch.moe_intermediate_size % n == 0,
                 f"the experts' intermediate size {arch.moe_intermediate_size} does not split {n} ways")
        shared = arch.num_shared_experts * arch.moe_intermediate_size
        need(shared % n == 0, f"the shared experts' intermediate size {shared} does not split {n} ways")
    elif tp.expert_parallel:
        raise ValueError("config field 'expert_parallel' is true, but the model has no experts")
