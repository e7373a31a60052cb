"""The demo models' task: addition of two decimal integers, written as text.

    prompt "123+4567="   answer "4690" then <|endoftext|>

Operands have 1 to MAX_DIGITS digits. The digit count is drawn first, uniformly, then the value uniformly
among the numbers of that many digits, so that short and long operands are equally common (uniform values
would make almost every operand MAX_DIGITS long). Answers are at most MAX_DIGITS + 1 digits, so the answer and
its EOS fit in GEN_LENGTH generated tokens.

Held-out problems: a pair (a, b) is held out when a hash of it falls in one of HELD_OUT_BUCKETS buckets.
Training never draws a held-out pair, and every evaluation set is drawn from held-out pairs only, so an
evaluation problem can never have been seen in training.

Tokens are bytes: the demo tokenizer maps each byte to the token of the same id (see
diffulex_backend.testing.checkpoint), so a prompt's token ids are its ASCII codes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID
from diffulex_backend.sampling import mix32

MAX_DIGITS = 4
PROMPT_WIDTH = 2 * MAX_DIGITS + 2  # the longest prompt: two operands, "+" and "="
ANSWER_WIDTH = MAX_DIGITS + 1
GEN_LENGTH = 8  # max_tokens that holds every answer and its EOS
HELD_OUT_BUCKETS = 16  # 1 pair in 16 is held out
PLUS, EQUALS, ZERO = ord("+"), ord("="), ord("0")

# Seeds of the fixed evaluation sets.
BENCHMARK_SEED = 2024
TEST_SEED = 7


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def is_held_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [N] int64 each -> [N] bool
    return mix32(mix32(a) ^ b) % HELD_OUT_BUCKETS == 0


def sample_operands(n: int, generator: torch.Generator, device="cpu") -> torch.Tensor:  # [n] int64
    digits = torch.randint(1, MAX_DIGITS + 1, (n,), generator=generator, device=device)
    high = 10 ** digits
    low = torch.where(digits == 1, 0, high // 10)
    return low + (torch.rand(n, generator=generator, device=device, dtype=torch.float64) * (high - low)).long()


def sample_training_pairs(n: int, generator: torch.Generator, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """n pairs that are not held out. Drawing 2n and keeping the first n kept ones never runs short in
    practice (15/16 are kept); the loop only makes it certain."""
    a_kept, b_kept, count = [], [], 0
    while count < n:
        a, b = sample_operands(2 * n, generator, device), sample_operands(2 * n, generator, device)
        keep = ~is_held_out(a, b)
        a_kept.append(a[keep])
        b_kept.append(b[keep])
        count += int(keep.sum())
    return torch.cat(a_kept)[:n], torch.cat(b_kept)[:n]


def held_out_problems(n: int, seed: int) -> list[Problem]:
    """n distinct held-out problems, the same for the same (n, seed)."""
    generator = torch.Generator().manual_seed(seed)
    problems: dict[Problem, None] = {}  # insertion-ordered set
    while len(problems) < n:
        a, b = sample_operands(64 * n, generator), sample_operands(64 * n, generator)
        keep = is_held_out(a, b)
        for x, y in zip(a[keep].tolist(), b[keep].tolist()):
            problems.setdefault(Problem(x, y))
    return list(problems)[:n]


def num_digits(x: torch.Tensor) -> torch.Tensor:  # [N] int64 >= 0 -> [N] int64 >= 1
    count = torch.ones_like(x)
    for k in range(1, MAX_DIGITS + 1):
        count += (x >= 10 ** k).long()
    return count


def digit_at(x: torch.Tensor, index: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The ASCII code of digit `index` (0 = most significant) of x, which has `length` digits."""
    power = (length - 1 - index).clamp(0, MAX_DIGITS)
    return ZERO + (x // 10 ** power) % 10


def encode_prompts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in PROMPT_WIDTH slots: tokens [N, PROMPT_WIDTH] (left padding is EOS) and the
    prompt lengths [N]. Right alignment puts every prompt's last token next to the generated area."""
    na, nb = num_digits(a), num_digits(b)
    length = na + nb + 2
    q = torch.arange(PROMPT_WIDTH, device=a.device)[None, :] - (PROMPT_WIDTH - length)[:, None]  # index in prompt
    na_, nb_ = na[:, None], nb[:, None]
    tokens = torch.where(q < na_, digit_at(a[:, None], q, na_), PLUS)
    tokens = torch.where(q > na_, digit_at(b[:, None], q - na_ - 1, nb_), tokens)
    tokens = torch.where(q == na_ + nb_ + 1, EQUALS, tokens)
    return torch.where(q < 0, EOS_TOKEN_ID, tokens), length


def encode_answers(a: torch.Tensor, b: torch.Tensor, gen_length: int) -> torch.Tensor:
    """The answer digits then EOS up to gen_length: [N, gen_length]."""
    total = a + b
    length = num_digits(total)[:, None]
    g = torch.arange(gen_length, device=a.device)[None, :]
    return torch.where(g < length, digit_at(total[:, None], g, length), EOS_TOKEN_ID)
