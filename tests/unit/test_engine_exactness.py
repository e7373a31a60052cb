"""Token-exact checks of the engine against plain references written here.

The references recompute the whole sequence at every step through a dense attention with an explicit mask
matrix, so neither the paged cache, the block-id mask encoding, the scheduler nor the batched acceptance code
takes part in them. Both sides run in float64: random models put many confidences within one float32 ulp of
each other, and a comparison of decoding decisions should not hinge on rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.testing.checkpoint import write_random_checkpoint
from diffulex_backend.loader import load_model

PROMPTS = ["The quick brown fox", "hi", "diffusion language models decode blocks in parallel"]


class DenseModel:
    """The checkpoint's model with attention replaced by a dense masked softmax over the fed tokens."""

    def __init__(self, path):
        self.mask = None
        self.model = load_model(path, dtype=torch.float64, attention_fn=self._attention)
        self.arch = self.model.arch
        self.mask_token_id = self.arch.mask_token_id

    def _attention(self, q, k, v, k_cache, v_cache, meta, scale):
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~self.mask, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits that predict each position of `tokens` (already shifted for shifted models)."""
        self.mask = mask
        n = tokens.numel()
        from diffulex_backend.attention import AttentionMetadata

        meta = AttentionMetadata(  # the dense attention above reads none of it
            cu_seqlens_q=torch.tensor([0, n]), context_lens=torch.tensor([0]), page_tables=torch.zeros(1, 1),
            slot_mapping=torch.full((n,), -1), block_ids=torch.zeros(n), max_seqlen_q=n, max_context_len=0,
            cu_seqlens_q_host=(0, n), context_lens_host=(0,))
        logits = self.model.compute_logits(self.model(tokens, torch.arange(n), meta, None))
        if self.arch.shifted:
            logits = torch.cat([logits[:1], logits[:-1]])
        logits[:, self.mask_token_id] = float("-inf")  # the engine never predicts the mask token
        return logits


def block_causal_mask(n: int, prompt_len: int, block_size: int, causal_prompt: bool) -> torch.Tensor:
    """mask[i, j]: position i may attend to position j."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    in_prompt_i, in_prompt_j = i < prompt_len, j < prompt_len
    prompt_part = (j <= i) if causal_prompt else torch.ones(n, n, dtype=torch.bool)
    block_i, block_j = (i - prompt_len) // block_size, (j - prompt_len) // block_size
    mask = torch.where(in_prompt_i, in_prompt_j & prompt_part, in_prompt_j | (block_j <= block_i))
    return mask


def reference_block_diffusion(dense, prompt, max_tokens, block_size, buffer_size, accept, add_block, semi_complete,
                              causal_prompt, mask_id):
    """Block diffusion as DESIGN.md describes it, one step at a time, recomputing everything."""
    p = len(prompt)
    x = torch.tensor(prompt + [mask_id] * max_tokens)
    spans = [(s, min(s + block_size, p + max_tokens)) for s in range(p, p + max_tokens, block_size)]

    def fill(k):
        s, e = spans[k]
        return float((x[s:e] != mask_id).float().mean())

    committed, joined = 0, 1
    while joined < len(spans) and joined - committed < buffer_size and fill(joined - 1) >= add_block:
        joined += 1
    while committed < len(spans):
        end = spans[joined - 1][1]
        logits = dense.logits(x[:end], block_causal_mask(end, p, block_size, causal_prompt))
        probs = logits.softmax(-1)
        conf, pred = probs.max(-1)
        new = x.clone()
        for k in range(committed, joined):
            s, e = spans[k]
            if k > committed and fill(k - 1) < semi_complete:
                continue
            masked = [i for i in range(s, e) if x[i] == mask_id]
            take = [i for i in masked if conf[i] >= accept]
            if not take and k == committed and masked:
                take = [max(masked, key=lambda i: (conf[i], -i))]
            for i in take:
                new[i] = pred[i]
        x = new
        while committed < joined and not bool((x[slice(*spans[committed])] == mask_id).any()):
            committed += 1
        while joined < len(spans) and joined - committed < buffer_size and (
                joined == committed or fill(joined - 1) >= add_block):
            joined += 1
    return x[p:].tolist()


def reference_llada(dense, prompt, gen_length, block_length, steps, mask_id):
    """LLaDA's semi-autoregressive sampler with low-confidence remasking, greedy, written plainly; equal
    confidences go to the lower position."""
    p = len(prompt)
    x = torch.tensor(prompt + [mask_id] * gen_length)
    full = torch.ones(len(x), len(x), dtype=torch.bool)
    for b in range(gen_length // block_length):
        s, e = p + b * block_length, p + (b + 1) * block_length
        n_masked = int((x[s:e] == mask_id).sum())
        base, extra = divmod(n_masked, steps)
        for i in range(steps):
            k = base + (1 if i < extra else 0)
            logits = dense.logits(x, full)
            x0 = logits.argmax(-1)
            x0_p = F.softmax(logits, dim=-1).gather(1, x0[:, None]).squeeze(1)
            x0_p[e:] = float("-inf")
            is_mask = x == mask_id
            confidence = torch.where(is_mask, x0_p, torch.tensor(float("-inf")))
            # torch.topk leaves the order of equal confidences open; the engine takes the lower position first.
            idx = torch.sort(confidence, descending=True, stable=True).indices[:k]
            x[idx] = x0[idx]
    return x[p:].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return {name: str(write_random_checkpoint(root / name, name, seed=3)) for name in ("llada", "dream", "sdar")}


@pytest.mark.parametrize("model_name", ["sdar", "dream"])
@pytest.mark.parametrize("buffer_size", [1, 3])
@pytest.mark.parametrize("page_size", [4, 8, 16])  # smaller than, equal to and larger than the block
def test_multi_bd_paged_matches_full_recompute(checkpoints, model_name, buffer_size, page_size):
    path = checkpoints[model_name]
    block_size, max_tokens, accept = 8, 20, 0.05
    # The thresholds that join and enable blocks act with a second block in flight only, and are refused without.
    thresholds = dict(add_block_threshold=0.25, semi_complete_threshold=0.5) if buffer_size > 1 else {}
    llm = Diffulex(path, decoding_strategy="multi_bd", block_size=block_size, buffer_size=buffer_size,
                   page_size=page_size, max_model_len=128, max_num_batched_tokens=128, accept_threshold=accept, dtype="float64",
                   enable_prefix_caching=False, **thresholds)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    dense = DenseModel(path)
    for prompt, out in zip(PROMPTS, outs):
        want = reference_block_diffusion(dense, llm.tokenizer.encode(prompt), max_tokens, block_size, buffer_size,
                                         accept, 0.25, 0.5, True, llm.config.mask_token_id)
        assert out.token_ids == want
    parallel = sum(len(o.token_ids) for o in outs) / sum(o.nfe for o in outs)
    assert parallel > 1.2, "the threshold should accept several tokens per forward, else this test proves little"
    assert llm.metrics().kv_pages_used == 0


def test_d2f_matches_full_recompute_with_bidirectional_prompt(checkpoints):
    path = checkpoints["sdar"]
    llm = Diffulex(path, decoding_strategy="d2f", block_size=8, buffer_size=2, page_size=4, max_model_len=128,
                   max_num_batched_tokens=128, accept_threshold=0.05, add_block_threshold=0.25, dtype="float64",
                   semi_complete_threshold=0.5)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    dense = DenseModel(path)
    for prompt, out in zip(PROMPTS, outs):
        want = reference_block_diffusion(dense, llm.tokenizer.encode(prompt), 16, 8, 2, 0.05, 0.25, 0.5, False,
                                         llm.config.mask_token_id)
        assert out.token_ids == want


@pytest.mark.parametrize("model_name", ["llada", "dream"])
@pytest.mark.parametrize("steps", [8, 2])  # steps = block_size and block_size / 4
def test_vanilla_matches_reference_llada_sampler(checkpoints, model_name, steps):
    path = checkpoints[model_name]
    llm = Diffulex(path, decoding_strategy="vanilla", block_size=8, max_model_len=128, max_num_batched_tokens=128,
                   dtype="float64")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, steps=steps, ignore_eos=True))
    dense = DenseModel(path)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_llada(dense, llm.tokenizer.encode(prompt), 24, 8, steps,
                                                llm.config.mask_token_id)
        assert out.nfe == 3 * steps
