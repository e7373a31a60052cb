"""The gated MLP of LLaMA-style blocks: down(silu(gate(x)) * up(x)).

gate and up are one fused matmul; the loader fills the two halves from the checkpoint's separate weights
(LLaDA ff_proj/up_proj, Qwen gate_proj/up_proj).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_backend.layers.lora import LoraBatch, LoraStack, add_lora


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # rows: [gate; up]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # The adapters' stacks (layers/lora.py), set when adapters are attached; None: no adapter targets them.
        self.gate_up_lora: LoraStack | None = None
        self.down_lora: LoraStack | None = None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:  # [T, hidden]
        gate, up = add_lora(self.gate_up_proj(x), x, self.gate_up_lora, lora).split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        return add_lora(self.down_proj(h), h, self.down_lora, lora)
