"""The shipped demo models answer held-out additions through the engine, in parallel, on CPU.

The floors are measured (docs/quality.md) with a margin of a few problems, so a change that breaks decoding
of a trained model fails here even when every random-weight exactness test still passes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from demo_objectives import block_batch, full_batch  # noqa: E402
from demo_task import (  # noqa: E402
    GEN_LENGTH, PROMPT_WIDTH, TEST_SEED, encode_answers, encode_prompts, held_out_problems, is_held_out,
    sample_training_pairs,
)
from train_demo import RECIPES, MaskedAttention, build_model, main as train_demo  # noqa: E402

from diffulex_backend import Diffulex, FinishReason, SamplingParams  # noqa: E402
from diffulex_backend.attention import AttentionMetadata, paged_attention_reference  # noqa: E402
from diffulex_backend.testing.checkpoint import MASK_TOKEN_ID  # noqa: E402
from diffulex_backend.registry import AutoModelForDiffusionLM  # noqa: E402

DEMO_LLADA = REPO / "model_repository" / "diffulex" / "demo-llada"
DEMO_SDAR = REPO / "checkpoints" / "demo-sdar"
CHECKPOINT_SIZE_LIMIT = 4 * 2**20  # bytes per shipped checkpoint, stated in docs/quality.md
NUM_PROBLEMS = 50
BLOCK_SIZE = 4


@pytest.fixture
def one_thread():
    """The models are tiny: one thread is as fast as several, and a busy CI host cannot oversubscribe it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("checkpoint, strategy, floor", [
    (DEMO_LLADA, "fast_dllm", 0.96),
    (DEMO_LLADA, "multi_bd", 0.96),
    (DEMO_SDAR, "multi_bd", 0.96),
], ids=["llada-fast_dllm", "llada-multi_bd", "sdar-multi_bd"])
def test_demo_model_answers_held_out_additions_with_several_tokens_per_forward(one_thread, checkpoint, strategy, floor):
    problems = held_out_problems(NUM_PROBLEMS, TEST_SEED)
    engine = Diffulex(str(checkpoint), decoding_strategy=strategy, block_size=BLOCK_SIZE, page_size=BLOCK_SIZE,
                      accept_threshold=0.9, max_model_len=PROMPT_WIDTH + GEN_LENGTH, max_num_reqs=NUM_PROBLEMS,
                      max_num_batched_tokens=NUM_PROBLEMS * (PROMPT_WIDTH + GEN_LENGTH), device="cpu")
    outputs = engine.generate([p.prompt for p in problems], SamplingParams(max_tokens=GEN_LENGTH))
    right = [o.text == p.answer and o.finish_reason == FinishReason.STOP for o, p in zip(outputs, problems)]
    wrong = [(p.prompt, o.text) for o, p, ok in zip(outputs, problems, right) if not ok]
    assert sum(right) / NUM_PROBLEMS >= floor, wrong
    decoded = sum(len(o.token_ids) + (o.finish_reason == FinishReason.STOP) for o in outputs)
    assert decoded / sum(o.nfe for o in outputs) > 1


def test_the_shipped_demo_model_serves_with_no_settings(one_thread):
    # No settings at all where there is no GPU; on a GPU machine only the device, since the default there would
    # take most of the GPU's memory for one test.
    engine = Diffulex(str(DEMO_LLADA), **({"device": "cpu"} if torch.cuda.is_available() else {}))
    assert engine.config.max_model_len == 512  # the checkpoint's max_position_embeddings
    problem = held_out_problems(1, TEST_SEED)[0]
    out = engine.generate(problem.prompt, SamplingParams(max_tokens=GEN_LENGTH))[0]
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and len(out.token_ids) <= GEN_LENGTH


@pytest.mark.parametrize("checkpoint, model_type", [(DEMO_LLADA, "llada"), (DEMO_SDAR, "sdar")])
def test_shipped_demo_checkpoint_is_in_its_family_layout_within_the_size_limit(checkpoint, model_type):
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == model_type
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in checkpoint.iterdir()}
    assert sum(p.stat().st_size for p in checkpoint.iterdir()) <= CHECKPOINT_SIZE_LIMIT


def test_evaluation_problems_are_held_out_and_training_never_draws_them():
    problems = held_out_problems(500, TEST_SEED)
    a, b = torch.tensor([p.a for p in problems]), torch.tensor([p.b for p in problems])
    assert bool(is_held_out(a, b).all())
    assert len(set(problems)) == 500
    ta, tb = sample_training_pairs(20000, torch.Generator().manual_seed(0))
    assert not bool(is_held_out(ta, tb).any())
    assert {(int(x), int(y)) for x, y in zip(ta, tb)}.isdisjoint({(p.a, p.b) for p in problems})


def test_prompts_and_answers_encode_as_the_demo_tokenizer_does():
    engine_tokenizer = Diffulex(str(DEMO_LLADA), max_model_len=64, max_num_reqs=1, device="cpu").tokenizer
    problems = held_out_problems(20, TEST_SEED)
    a, b = torch.tensor([p.a for p in problems]), torch.tensor([p.b for p in problems])
    prompts, lengths = encode_prompts(a, b)
    answers = encode_answers(a, b, GEN_LENGTH)
    for problem, prompt, length, answer in zip(problems, prompts, lengths, answers):
        assert prompt[PROMPT_WIDTH - int(length):].tolist() == engine_tokenizer.encode(problem.prompt)
        digits = len(problem.answer)
        assert answer[:digits].tolist() == engine_tokenizer.encode(problem.answer)
        assert answer[digits:].tolist() == [engine_tokenizer.eos_token_id] * (GEN_LENGTH - digits)


def engine_logits(model, tokens: list[int], block_ids: list[int]) -> torch.Tensor:
    n = len(tokens)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n]), context_lens=torch.tensor([0]), page_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.full((n,), -1), block_ids=torch.tensor(block_ids, dtype=torch.int32), max_seqlen_q=n,
        max_context_len=0, cu_seqlens_q_host=(0, n), context_lens_host=(0,))
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), meta, None))


@pytest.mark.parametrize("model_name", ["llada", "sdar"])
def test_training_batches_compute_what_the_engine_computes_when_it_serves(model_name):
    """Training's padded, explicitly masked forward equals the engine's attention on the same tokens: full
    attention for FULL; for BLOCK, a noised block after the causal prompt and its clean predecessors."""
    attention = MaskedAttention()
    model, _ = build_model(RECIPES[model_name], attention, torch.device("cpu"), seed=0)
    model = model.double().requires_grad_(False)
    weights = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough that attention is far from uniform, so a wrong mask shows
        for param in model.parameters():
            param.normal_(0.0, 0.3, generator=weights)
    family = AutoModelForDiffusionLM.get(model_name)
    served = family.empty(model.arch, paged_attention_reference, dtype=torch.float64, device="cpu")
    served.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    a, b = sample_training_pairs(3, generator)
    prompt, prompt_len = encode_prompts(a, b)
    answer = encode_answers(a, b, GEN_LENGTH)
    full = full_batch(prompt, prompt_len, answer, MASK_TOKEN_ID, generator, BLOCK_SIZE)
    block = block_batch(prompt, prompt_len, answer, MASK_TOKEN_ID, generator, BLOCK_SIZE)
    with torch.no_grad():
        trained = {}
        for name, batch in (("full", full), ("block", block)):
            attention.mask = batch.attention_mask
            hidden = model(batch.input_ids.flatten(), batch.positions.flatten(), None, None)
            trained[name] = model.compute_logits(hidden).view(*batch.input_ids.shape, -1)
        for row in range(3):
            n = int(prompt_len[row])
            prompt_ids = prompt[row, PROMPT_WIDTH - n:].tolist()
            noised = full.input_ids[row, PROMPT_WIDTH:].tolist()
            expected = engine_logits(served, prompt_ids + noised, [0] * (n + GEN_LENGTH))[n:]
            torch.testing.assert_close(trained["full"][row, PROMPT_WIDTH:], expected)
            for k in range(GEN_LENGTH // BLOCK_SIZE):
                span = slice(PROMPT_WIDTH + GEN_LENGTH + k * BLOCK_SIZE, PROMPT_WIDTH + GEN_LENGTH + (k + 1) * BLOCK_SIZE)
                tokens = prompt_ids + answer[row, :k * BLOCK_SIZE].tolist() + block.input_ids[row, span].tolist()
                block_ids = list(range(n)) + [n + i // BLOCK_SIZE * BLOCK_SIZE for i in range((k + 1) * BLOCK_SIZE)]
                expected = engine_logits(served, tokens, block_ids)[n + k * BLOCK_SIZE:]
                torch.testing.assert_close(trained["block"][row, span], expected)


@pytest.mark.parametrize("model_name", ["llada", "sdar"])
def test_training_script_writes_a_checkpoint_the_engine_loads(one_thread, tmp_path, model_name):
    import json

    out = tmp_path / model_name
    train_demo([model_name, str(out), "--steps", "2", "--batch-size", "4", "--log-every", "1",
                "--eval-batch-size", "4", "--device", "cpu"])
    engine = Diffulex(str(out), decoding_strategy="multi_bd", block_size=BLOCK_SIZE, max_model_len=64,
                      max_num_reqs=1, device="cpu")
    assert engine.config.model_name == model_name
    assert engine.model.arch.num_layers == RECIPES[model_name].num_layers
    assert engine.model.arch.block_size == RECIPES[model_name].config_block_size
    assert [h["step"] for h in json.loads((out / "training.json").read_text())["history"]] == [1, 2]
