"""DiffusionGemma against transformers' own DiffusionGemmaForBlockDiffusion, run in float64 (its norms, RoPE and
logits stay float32): the same logits for a prompt longer than the sliding window and a canvas, with and without a
self-conditioning input, where transformers' encoder fills a cache and its decoder reads it; and a checkpoint that
transformers itself saves (vision tower, the encoder's layer scalars, `per_layer_config` in place of
`global_head_dim`) loads and decodes the same tokens as the one it was made from.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

from diffulex_backend import Diffulex, SamplingParams
from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.loader import load_model
from diffulex_backend.testing.diffusion_gemma_checkpoint import TINY, write_random_diffusion_gemma_checkpoint

CANVAS = TINY["canvas_length"]
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(ours, transformers' save of it, transformers' model in float64)."""
    root = tmp_path_factory.mktemp("gemma_hf")
    ours = write_random_diffusion_gemma_checkpoint(root / "ours", seed=3)
    # The eager experts loop: the grouped-GEMM one takes no float64.
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(ours, dtype=torch.float64, experts_implementation="eager",
                                                            attn_implementation="eager").eval()
    model.save_pretrained(root / "hf")
    for name in SIDE_FILES:
        shutil.copy(ours / name, root / "hf" / name)
    return ours, root / "hf", model


def one_sequence_meta(n_causal: int, n: int) -> AttentionMetadata:
    """One sequence, no cache: rows before n_causal causal, the rest one canvas."""
    block_ids = torch.cat([torch.arange(n_causal), torch.full((n - n_causal,), n_causal)]).int()
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([0], dtype=torch.int32),
        page_tables=torch.full((1, 1), -1, dtype=torch.int32), slot_mapping=torch.full((n,), -1, dtype=torch.long),
        block_ids=block_ids, max_seqlen_q=n, max_context_len=0, cu_seqlens_q_host=(0, n), context_lens_host=(0,))


@pytest.mark.parametrize("self_conditioned", [False, True])
def test_canvas_logits_match_transformers_in_float64(checkpoints, self_conditioned):
    _, hf_dir, theirs = checkpoints
    ours = load_model(hf_dir, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    vocab = ours.arch.vocab_size
    prompt = torch.randint(1, vocab, (3 * TINY["sliding_window"] - 1,), generator=generator)  # crosses the window
    canvas = torch.randint(0, vocab, (CANVAS,), generator=generator)
    previous = torch.randn(CANVAS, vocab, generator=generator, dtype=torch.float64) * 3 if self_conditioned else None
    with torch.no_grad():
        expected = theirs(input_ids=prompt[None], decoder_input_ids=canvas[None],
                          past_key_values=DynamicCache(config=theirs.config.text_config),
                          self_conditioning_logits=None if previous is None else previous[None]).logits[0]
        n_causal, n = len(prompt), len(prompt) + CANVAS
        rows_canvas = torch.arange(n) >= n_causal
        soft = torch.zeros(n, ours.arch.hidden_size, dtype=torch.float64)
        if previous is not None:
            soft[n_causal:] = ours.soft_embeddings(previous.softmax(-1))
        hidden = ours(torch.cat([prompt, canvas]), torch.arange(n), one_sequence_meta(n_causal, n), None,
                      canvas=rows_canvas, soft_embeds=soft)
        got = ours.compute_logits(hidden[n_causal:])
    # Transformers computes its norms, RoPE angles and soft-capped logits in float32 whatever the model's dtype:
    # the two agree to float32 rounding (logits of up to 30 within 1e-3), and on every argmax.
    expected = expected.double()
    assert (got - expected).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_checkpoint_transformers_saves_loads_and_decodes_the_same_tokens(checkpoints):
    ours, hf_dir, _ = checkpoints
    config = json.loads((hf_dir / "config.json").read_text())
    assert "per_layer_config" in config["text_config"] and "global_head_dim" not in config["text_config"]
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert any(name.startswith("model.encoder.vision_tower.") for name in names)
    assert "model.encoder.language_model.layers.0.layer_scalar" in names
    settings = dict(model_name="diffusion_gemma", block_size=CANVAS, page_size=4, max_model_len=96,
                    dtype="float64", device="cpu")
    params = SamplingParams(max_tokens=2 * CANVAS, seed=21, ignore_eos=True)
    saved, written = Diffulex(str(hf_dir), **settings), Diffulex(str(ours), **settings)
    assert saved.model.arch.global_head_dim == written.model.arch.global_head_dim == TINY["global_head_dim"]
    # Both spellings of the config (the release's keys, transformers 5's per_layer_config) load without a key the
    # family does not know.
    assert saved.model.arch.unrecognized_config_keys == written.model.arch.unrecognized_config_keys == ()
    assert saved.generate(["a prompt"], params)[0].token_ids == written.generate(["a prompt"], params)[0].token_ids
