"""The gated MLP of LLaMA-style blocks: down(silu(gate(x)) * up(x)).

gate and up are one fused matmul; the loader fills the two halves from the checkpoint's separate weights
(LLaDA ff_proj/up_proj, Qwen gate_proj/up_proj).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_backend.layers.lora import LoraBatch, LoraStack, add_lora
from diffulex_backend.tensor_parallel import TensorParallel


class GatedMLP(nn.Module):
    """Under tensor parallelism this rank's share of the intermediate columns (column-parallel gate_up,
    row-parallel down): the output is summed over ranks, unless `reduce` is off because the caller sums it with
    other partial outputs first (a MoE layer's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = TensorParallel(),
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.intermediate_size = intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # rows: [gate; up]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # The adapters' stacks (layers/lora.py), set when adapters are attached; None: no adapter targets them.
        self.gate_up_lora: LoraStack | None = None
        self.down_lora: LoraStack | None = None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:  # [T, hidden]
        gate, up = add_lora(self.gate_up_proj(x), x, self.gate_up_lora, lora).split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        out = add_lora(self.down_proj(h), h, self.down_lora, lora)
        return self.tp.all_reduce(out) if self.reduce else out
