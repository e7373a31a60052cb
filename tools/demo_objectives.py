"""The two training objectives of the demo models, as padded batches with an explicit attention mask.

Both are masked diffusion on the generated area: a position is replaced by the mask token with probability
p, and the loss is the cross-entropy of the clean token at masked positions, weighted 1/p (the masked
diffusion bound; with p = t for every position it is LLaDA's 1/t weighting).

FULL (LLaDA): prompt + generated area, every token sees every other one. p = t ~ U(0, 1] for the whole
area, or, for half the rows, the state semi-autoregressive decoding passes through: blocks before a cut
are clean, the cut block is masked with probability t, the blocks after it are all mask.

BLOCK (SDAR): the prompt, a clean copy of the generated area and a noised copy, in one sequence of
PROMPT_WIDTH + 2 * G tokens. The copies share positions. Masks:
  prompt token   the prompt tokens before it (causal, as multi_bd feeds a prompt)
  clean block k  the prompt and clean blocks <= k (the K/V a committed block has in the cache)
  noised block k the prompt, clean blocks < k and noised block k (what an in-flight block sees)
so one forward trains every block against clean predecessors. Each block has its own t.

Layout: prompts are right-aligned in PROMPT_WIDTH slots (demo_task.encode_prompts); left padding is hidden
from every query, and a padding query sees only itself so that no softmax row is empty.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from demo_task import PROMPT_WIDTH

MIN_MASK_RATE = 1e-3  # t ~ U(MIN_MASK_RATE, 1], so 1/t stays bounded


class Objective(enum.Enum):
    FULL = "full"
    BLOCK = "block"


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # [B, L] int64
    positions: torch.Tensor  # [B, L] int64: the position the engine gives the token
    attention_mask: torch.Tensor  # [B, L, L] bool: query i may attend to key j
    targets: torch.Tensor  # [B, L] int64: the clean token (meaningful where loss_weight > 0)
    loss_weight: torch.Tensor  # [B, L] float32: 1/p at masked positions of the predicted copy, else 0
    num_predicted: int  # B * G: the positions the loss is an average over


def prompt_positions(prompt_len: torch.Tensor) -> torch.Tensor:  # [B] -> [B, PROMPT_WIDTH], < 0 on padding
    slots = torch.arange(PROMPT_WIDTH, device=prompt_len.device)[None, :]
    return slots - (PROMPT_WIDTH - prompt_len)[:, None]


def mask_rates(batch: int, count: int, generator: torch.Generator, device) -> torch.Tensor:  # [batch, count]
    return MIN_MASK_RATE + (1 - MIN_MASK_RATE) * torch.rand(batch, count, generator=generator, device=device)


def semi_ar_rates(t: torch.Tensor, gen_length: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """p [B, G]: 0 before a random cut block, t inside it, 1 after it. t: [B, 1]."""
    num_blocks = -(-gen_length // block_size)
    cut = torch.randint(0, num_blocks, (t.shape[0], 1), generator=generator, device=t.device)
    block = torch.arange(gen_length, device=t.device)[None, :] // block_size
    return torch.where(block < cut, 0.0, torch.where(block == cut, t, 1.0))


def noise(answer: torch.Tensor, rates: torch.Tensor, mask_token_id: int, generator: torch.Generator):
    """Mask each position with its rate: (noised tokens, loss weights 1/p at masked positions)."""
    masked = torch.rand(rates.shape, generator=generator, device=rates.device) < rates
    weight = torch.where(masked, 1.0 / rates.clamp_min(MIN_MASK_RATE), 0.0)
    return torch.where(masked, mask_token_id, answer), weight


def full_batch(prompt: torch.Tensor, prompt_len: torch.Tensor, answer: torch.Tensor, mask_token_id: int,
               generator: torch.Generator, semi_ar_block_size: int, all_masked: bool = False) -> TrainingBatch:
    """prompt [B, PROMPT_WIDTH], prompt_len [B], answer [B, G] (answer then EOS padding)."""
    batch, gen_length = answer.shape
    device = answer.device
    ppos = prompt_positions(prompt_len)
    gpos = prompt_len[:, None] + torch.arange(gen_length, device=device)[None, :]
    if all_masked:
        rates = torch.ones(batch, gen_length, device=device)
    else:
        t = mask_rates(batch, 1, generator, device)
        structured = torch.rand(batch, 1, generator=generator, device=device) < 0.5
        rates = torch.where(structured, semi_ar_rates(t, gen_length, semi_ar_block_size, generator),
                            t.expand(batch, gen_length))
    noised, weight = noise(answer, rates, mask_token_id, generator)
    valid = torch.cat([ppos >= 0, torch.ones_like(answer, dtype=torch.bool)], dim=1)  # [B, L]
    length = valid.shape[1]
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return TrainingBatch(
        input_ids=torch.cat([prompt, noised], dim=1),
        positions=torch.cat([ppos.clamp_min(0), gpos], dim=1),
        attention_mask=valid[:, None, :] | eye,
        targets=torch.cat([prompt, answer], dim=1),
        loss_weight=torch.cat([torch.zeros_like(prompt, dtype=torch.float32), weight], dim=1),
        num_predicted=batch * gen_length,
    )


def block_batch(prompt: torch.Tensor, prompt_len: torch.Tensor, answer: torch.Tensor, mask_token_id: int,
                generator: torch.Generator, block_size: int, all_masked: bool = False) -> TrainingBatch:
    """The clean/noised two-copy batch; see the module docstring. Shapes as in full_batch."""
    batch, gen_length = answer.shape
    device = answer.device
    num_blocks = -(-gen_length // block_size)
    ppos = prompt_positions(prompt_len)
    g = torch.arange(gen_length, device=device)
    gpos = prompt_len[:, None] + g[None, :]
    block = g // block_size  # [G]
    if all_masked:
        rates = torch.ones(batch, gen_length, device=device)
    else:
        rates = mask_rates(batch, num_blocks, generator, device)[:, block]
    noised, weight = noise(answer, rates, mask_token_id, generator)

    # Per-token descriptors of the L = PROMPT_WIDTH + 2G sequence: which part, its position, its block.
    prompt_part, clean_part, noised_part = 0, 1, 2
    part = torch.cat([torch.full((PROMPT_WIDTH,), prompt_part), torch.full((gen_length,), clean_part),
                      torch.full((gen_length,), noised_part)]).to(device)  # [L]
    blk = torch.cat([torch.full((PROMPT_WIDTH,), -1, device=device), block, block])  # [L]
    pos = torch.cat([ppos, gpos, gpos], dim=1)  # [B, L]
    valid = pos >= 0
    qi, kj = (slice(None), slice(None), None), (slice(None), None, slice(None))  # [B, L, 1] and [B, 1, L]
    part_q, part_k = part[None, :, None], part[None, None, :]
    blk_q, blk_k = blk[None, :, None], blk[None, None, :]
    prompt_key = (part_k == prompt_part) & valid[kj]
    mask = torch.where(part_q == prompt_part, prompt_key & (pos[kj] <= pos[qi]),
                       torch.where(part_q == clean_part,
                                   prompt_key | ((part_k == clean_part) & (blk_k <= blk_q)),
                                   prompt_key | ((part_k == clean_part) & (blk_k < blk_q))
                                   | ((part_k == noised_part) & (blk_k == blk_q))))
    mask |= torch.eye(mask.shape[1], dtype=torch.bool, device=device)
    zeros = torch.zeros(batch, PROMPT_WIDTH + gen_length, device=device)
    return TrainingBatch(
        input_ids=torch.cat([prompt, answer, noised], dim=1),
        positions=pos.clamp_min(0),
        attention_mask=mask,
        targets=torch.cat([prompt, answer, answer], dim=1),
        loss_weight=torch.cat([zeros, weight], dim=1),
        num_predicted=batch * gen_length,
    )
