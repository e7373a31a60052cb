"""The gated MLP of LLaMA-style blocks: down(silu(gate(x)) * up(x)).

gate and up are one fused matmul; the loader fills the two halves from the checkpoint's separate weights
(LLaDA ff_proj/up_proj, Qwen gate_proj/up_proj).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # rows: [gate; up]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
