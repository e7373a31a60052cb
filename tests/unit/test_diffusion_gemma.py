"""DiffusionGemma and its uniform-diffusion sampler: the engine's tokens against a float64 reference written here
from the formulas (a dense forward with explicit causal, canvas and window masks, no cache; transformers' sampler
loop step by step), unchanged by batching, preemption and prefix hits; seeded reproducibility; the stability rule on
a crafted model; and the refusals of what is not built.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from diffulex_backend import Diffulex, FinishReason, SamplingParams
from diffulex_backend.loader import CheckpointError, detect_model_name
from diffulex_backend.refusal import Refusal
from diffulex_backend.testing.checkpoint import EOS_TOKEN_ID
from diffulex_backend.testing.diffusion_gemma_checkpoint import (
    TINY, TINY_SCHEDULE, write_random_diffusion_gemma_checkpoint)
from diffulex_backend.strategies import diffusion_gemma as strategy
from engine_driver import Stream, drain, run_one_at_a_time, run_requests
from families import ENORMOUS

CANVAS = TINY["canvas_length"]
SETTINGS = dict(model_name="diffusion_gemma", block_size=CANVAS, page_size=4, max_model_len=128,
                max_num_batched_tokens=64, dtype="float64", device="cpu")
PROMPTS = ["the quick brown fox jumps", "ab", "a prompt long enough to cross the window twice", "xyz!"]
NON_FINITE_ERROR = ("decoding failed: the model's logits for this request hold NaN or infinite values, so its tokens "
                    "would be noise")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Random weights never repeat an argmax canvas: every canvas runs all its steps."""
    return str(write_random_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("gemma") / "ckpt", seed=5))


@pytest.fixture(scope="module")
def early_stop_checkpoint(tmp_path_factory):
    """No stability rule and a confidence bound the random model's mean entropy crosses after a step or two: canvases
    end at different steps."""
    schedule = dataclasses.replace(TINY_SCHEDULE, stability_threshold=0, confidence_threshold=1.0)
    return str(write_random_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("gemma") / "early", seed=5,
                                                       schedule=schedule))


def engine(path, **settings) -> Diffulex:
    return Diffulex(path, **{**SETTINGS, **settings})


# --- the reference: written from the formulas, reading the safetensors by their released names -------------------

def mix32(x):
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def noise_key(seed, position, step):
    """The engine's per-position noise key: murmur3 finalizers over (seed, position, step)."""
    return mix32(seed ^ mix32(position * 0x9E3779B1 + mix32(step)))


def uniforms(key, vocab):
    h = mix32(key[:, None] ^ mix32(torch.arange(vocab))[None, :])
    return ((h >> 9).double() + 0.5) / (1 << 23)


class Reference:
    def __init__(self, path):
        config = json.loads(open(f"{path}/config.json").read())
        gen = json.loads(open(f"{path}/generation_config.json").read())
        self.c = c = config["text_config"]
        self.canvas = config["canvas_length"]
        self.steps, self.t_min, self.t_max = gen["max_denoising_steps"], gen["t_min"], gen["t_max"]
        self.bound = gen["sampler_config"]["entropy_bound"]
        self.stability, self.confidence = gen["stability_threshold"], gen["confidence_threshold"]
        weights = load_file(f"{path}/model.safetensors")
        self.w = {k.removeprefix("model.decoder."): v.double() for k, v in weights.items()}
        self.eps, self.h = c["rms_norm_eps"], c["hidden_size"]

    def norm(self, x, name=None):
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return y if name is None else y * self.w[name]

    def mlp(self, x, p):
        return (F.gelu(x @ self.w[p + "gate_proj.weight"].T, approximate="tanh") * (x @ self.w[p + "up_proj.weight"].T)
                ) @ self.w[p + "down_proj.weight"].T

    def rope(self, x, pos, head_dim, rotated, theta):
        inv = torch.zeros(head_dim // 2, dtype=torch.float64)
        inv[:rotated // 2] = theta ** (-torch.arange(0, rotated, 2, dtype=torch.float64) / head_dim)
        ang = pos.double()[:, None] * inv[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., :head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def hidden(self, tokens, n_causal, soft):
        """Final hidden states of all rows: rows < n_causal causal (the encoder), the rest one canvas."""
        c, n = self.c, len(tokens)
        x = self.w["embed_tokens.weight"][tokens] * math.sqrt(self.h)
        sc = "self_conditioning."
        x[n_causal:] = self.norm(x[n_causal:] + self.mlp(self.norm(soft, sc + "pre_norm.weight"), sc))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        in_canvas = i >= n_causal
        full_mask = in_canvas | (j <= i)
        window = c["sliding_window"]
        sliding_mask = full_mask & torch.where(in_canvas, j > n_causal - window, i - j < window)
        pos = torch.arange(n)
        for layer, kind in enumerate(c["layer_types"]):
            p = f"layers.{layer}."
            full = kind == "full_attention"
            d = c["global_head_dim"] if full else c["head_dim"]
            kvh = c["num_global_key_value_heads"] if full else c["num_key_value_heads"]
            rope = c["rope_parameters"][kind]
            rotated = int(d * rope.get("partial_rotary_factor", 1.0))
            a = self.norm(x, p + "input_layernorm.weight")
            q = self.norm((a @ self.w[p + "self_attn.q_proj.weight"].T).view(n, -1, d), p + "self_attn.q_norm.weight")
            raw_k = (a @ self.w[p + "self_attn.k_proj.weight"].T).view(n, kvh, d)
            raw_v = raw_k if full else (a @ self.w[p + "self_attn.v_proj.weight"].T).view(n, kvh, d)
            k, v = self.norm(raw_k, p + "self_attn.k_norm.weight"), self.norm(raw_v)
            q, k = self.rope(q, pos, d, rotated, rope["rope_theta"]), self.rope(k, pos, d, rotated, rope["rope_theta"])
            group = q.shape[1] // kvh
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("ihd,jhd->hij", q, k)  # scale 1
            scores = scores.masked_fill(~(full_mask if full else sliding_mask), float("-inf"))
            o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(n, -1)
            o = o @ self.w[p + "self_attn.o_proj.weight"].T
            x = x + self.norm(o, p + "post_attention_layernorm.weight")
            ff = self.mlp(self.norm(x, p + "pre_feedforward_layernorm.weight"), p + "mlp.")
            if c.get("num_experts"):
                r = self.norm(x) * self.w[p + "router.scale"] * self.h ** -0.5
                probs = (r @ self.w[p + "router.proj.weight"].T).softmax(-1)
                top, idx = probs.topk(c["top_k_experts"], -1)
                top = top / top.sum(-1, keepdim=True) * self.w[p + "router.per_expert_scale"][idx]
                e_in = self.norm(x, p + "pre_feedforward_layernorm_2.weight")
                moe = torch.zeros_like(x)
                for t in range(n):
                    for slot in range(idx.shape[1]):
                        e = idx[t, slot]
                        gate, up = (self.w[p + "experts.gate_up_proj"][e] @ e_in[t]).chunk(2)
                        act = F.gelu(gate, approximate="tanh") * up
                        moe[t] += top[t, slot] * (self.w[p + "experts.down_proj"][e] @ act)
                ff = (self.norm(ff, p + "post_feedforward_layernorm_1.weight")
                      + self.norm(moe, p + "post_feedforward_layernorm_2.weight"))
            # Canvas rows are the decoder's; causal rows the encoder's, whose layer scalar is stored apart.
            scalar = torch.where(in_canvas[:, 0, None], self.w[p + "layer_scalar"],
                                 self.w[f"model.encoder.language_model.{p}layer_scalar"])
            x = (x + self.norm(ff, p + "post_feedforward_layernorm.weight")) * scalar
        return self.norm(x, "norm.weight")

    def logits(self, h):
        logits = h @ self.w["embed_tokens.weight"].T
        cap = self.c.get("final_logit_softcapping")
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def generate(self, prompt, max_tokens, seed, stop=(EOS_TOKEN_ID,)):
        """(output tokens, forwards that denoised): transformers' canvas loop, one canvas at a time."""
        vocab, size = self.w["embed_tokens.weight"].shape[0], self.canvas
        tokens, out, steps_taken = list(prompt), [], 0
        while len(out) < max_tokens:
            start = len(tokens)
            pos = torch.arange(start, start + size)
            canvas = mix32(noise_key(seed ^ 0x0C4A7A50, pos, torch.zeros_like(pos))) % vocab
            soft = torch.zeros(size, self.h, dtype=torch.float64)
            last, repeats = torch.full((size,), -1), 0
            for s in range(self.steps):
                steps_taken += 1
                logits = self.logits(self.hidden(torch.tensor(tokens + canvas.tolist()), start, soft)[start:])
                scaled = logits / (self.t_min + (self.t_max - self.t_min) * (self.steps - s) / self.steps)
                step = torch.full_like(pos, s)
                sampled = (scaled - torch.log(-torch.log(uniforms(noise_key(seed, pos, step), vocab)))).argmax(-1)
                argmax = scaled.argmax(-1)
                probs = scaled.softmax(-1)
                entropy = -(probs * scaled.log_softmax(-1)).sum(-1)
                order = entropy.argsort(stable=True)
                keep = torch.zeros(size, dtype=torch.bool)
                keep[order] = entropy[order].cumsum(0) - entropy[order] <= self.bound
                stable = self.stability == 0 or (repeats >= self.stability and bool((argmax == last).all()))
                repeats = repeats + 1 if bool((argmax == last).all()) else 1
                last = argmax
                if (stable and entropy.mean() < self.confidence) or s + 1 == self.steps:
                    canvas = argmax
                    break
                canvas = torch.where(keep, sampled, mix32(noise_key(seed ^ 0x5E701CE5, pos, step)) % vocab)
                soft = probs @ self.w["embed_tokens.weight"] * math.sqrt(self.h)
            new = canvas.tolist()[: max_tokens - len(out)]
            hits = [i for i, t in enumerate(new) if t in stop]
            if hits:
                return out + new[: hits[0]], steps_taken
            tokens += canvas.tolist()
            out += new
        return out, steps_taken


# --- what the family is -------------------------------------------------------------------------------------------

def test_config_json_names_the_family_and_its_strategy(checkpoint):
    config = json.loads(open(f"{checkpoint}/config.json").read())
    assert detect_model_name(config, "config.json") == "diffusion_gemma"
    llm = Diffulex(checkpoint, **{**SETTINGS, "model_name": None, "decoding_strategy": "diffusion_gemma"})
    arch = llm.model.arch
    assert (arch.model_name, arch.canvas_length) == ("diffusion_gemma", CANVAS)
    assert arch.layer_types == tuple(TINY["layer_types"])
    assert arch.schedule == TINY_SCHEDULE  # from generation_config.json
    assert engine(checkpoint).config.decoding_strategy == "diffusion_gemma"  # the family's default


def test_forward_matches_the_dense_reference_with_window_masks(checkpoint):
    """A prompt four windows long, prefilled in chunks through the paged cache, then a canvas: the same hidden
    states as one dense forward whose sliding layers mask by the window."""
    llm = engine(checkpoint, max_num_batched_tokens=16)
    ref = Reference(checkpoint)
    prompt = list(range(40, 64))
    out = llm.generate([prompt], SamplingParams(max_tokens=CANVAS, seed=11, ignore_eos=True))[0]
    expected, _ = ref.generate(prompt, CANVAS, seed=11, stop=())
    assert out.token_ids == expected


def test_sliding_layers_never_read_pages_outside_their_window(checkpoint):
    """Once a 30-token prompt is cached, the sliding layers' K/V of the pages wholly before its last window are
    overwritten with NaN: a read of any of them would spread NaN into every logit. The tokens stay those of a clean
    run."""
    params = SamplingParams(max_tokens=2 * CANVAS, seed=5, ignore_eos=True)
    prompt = list(range(40, 70))
    clean = engine(checkpoint).generate([prompt], params)[0].token_ids
    llm = engine(checkpoint)
    rid = llm.add_request(prompt, params)
    tokens = [t for delta in llm.step() for t in delta.token_ids]  # prompt and first canvas step in one forward
    req, arch, page = llm.requests[rid], llm.model.arch, llm.config.page_size
    first_read = len(prompt) - arch.sliding_window + 1
    outside = req.page_table[:first_read // page]
    for layer, kind in enumerate(arch.layer_types):
        if kind == "sliding_attention":
            for cache in llm.model.layer_cache(llm.runner.kv_cache, layer):
                cache[outside] = float("nan")
    while llm.has_unfinished_requests():
        tokens += [t for delta in llm.step() for t in delta.token_ids]
    assert len(outside) >= 5 and tokens == clean


def test_each_layer_caches_its_own_width_and_no_layer_writes_another_s_columns(checkpoint):
    """The cache row holds every layer's K (or V) at the layer's own shape, the full layers' differing from the
    sliding ones'. Poisoning every column but one layer's changes nothing that layer reads: its views are its
    columns alone."""
    llm = engine(checkpoint)
    arch, cache = llm.model.arch, llm.runner.kv_cache
    shapes = [arch.layer_shape(layer) for layer in range(arch.num_layers)]
    assert len(set(shapes)) > 1  # the premise: layers of more than one shape
    assert cache.shape == (2, llm.kv_cache.num_pages, llm.config.page_size, sum(h * d for h, d in shapes))
    for layer, (heads, size) in enumerate(shapes):
        k, v = llm.model.layer_cache(cache, layer)
        assert k.shape == v.shape == (llm.kv_cache.num_pages, llm.config.page_size, heads, size)
        cache.fill_(float("nan"))
        k.fill_(1.0)
        v.fill_(2.0)
        assert not k.isnan().any() and not v.isnan().any()
        assert int((~cache.isnan()).sum()) == 2 * k.numel()  # no other layer's columns were written


# --- decoding --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [CANVAS, 2 * CANVAS + 3])
@pytest.mark.parametrize("which", ["checkpoint", "early_stop_checkpoint"])
def test_tokens_match_the_reference_sampler(request, which, max_tokens):
    path = request.getfixturevalue(which)
    llm, ref = engine(path), Reference(path)
    nfes = set()
    for i, prompt in enumerate(PROMPTS[:3]):
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, seed=100 + i))[0]
        expected, steps = ref.generate(ids, max_tokens, seed=100 + i)
        assert out.token_ids == expected, prompt
        assert out.nfe == steps  # every forward is a denoising step
        nfes.add(out.nfe)
    if which == "early_stop_checkpoint" and max_tokens > CANVAS:
        assert len(nfes) > 1  # the early stop is taken at different steps


def test_a_stop_token_ends_the_request_where_the_reference_cuts(checkpoint):
    llm, ref = engine(checkpoint), Reference(checkpoint)
    ids = llm.tokenizer.encode(PROMPTS[0])
    full, _ = ref.generate(ids, 2 * CANVAS, seed=4, stop=())
    stop = full[CANVAS + 2]  # a token of the second canvas
    expected, _ = ref.generate(ids, 2 * CANVAS, seed=4, stop=(stop,))
    out = llm.generate([ids], SamplingParams(max_tokens=2 * CANVAS, seed=4, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out.token_ids == expected == full[:full.index(stop)]
    assert out.finish_reason.value == "stop"


def test_tokens_unchanged_by_batching_preemption_and_prefix_hits(checkpoint):
    params = [SamplingParams(max_tokens=2 * CANVAS, seed=7 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    alone = [s.token_ids for s in run_one_at_a_time(engine(checkpoint), PROMPTS, params)]
    batched = engine(checkpoint)
    assert [s.token_ids for s in run_requests(batched, PROMPTS, params)] == alone
    # A second round hits the prefix cache for every prompt.
    again = run_requests(batched, PROMPTS, params)
    assert batched.metrics().prefix_cache_hit_tokens > 0
    assert [s.token_ids for s in again] == alone
    # Pages for little more than two requests: the others are preempted and restart their canvas.
    small = engine(checkpoint, num_kv_pages=18, enable_prefix_caching=False)
    assert [s.token_ids for s in run_requests(small, PROMPTS, params)] == alone
    assert small.scheduler.num_preemptions > 0


def test_seeded_requests_repeat_and_seeds_differ(checkpoint):
    llm = engine(checkpoint)
    first = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=CANVAS, seed=1, ignore_eos=True))[0].token_ids
    again = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=CANVAS, seed=1, ignore_eos=True))[0].token_ids
    other = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=CANVAS, seed=2, ignore_eos=True))[0].token_ids
    assert first == again and first != other


@pytest.mark.parametrize("stability", [0, 1, 3])
def test_a_canvas_ends_once_its_argmax_repeats_for_stability_threshold_steps(tmp_path, stability):
    """A crafted model whose every position predicts its own input token with certainty (the layers add nothing,
    the head is the embedding, no soft cap): the argmax canvas is the random starting canvas at every step, and
    every step is confident, so a canvas ends after exactly stability + 1 steps (stability 0: after one) with the
    starting canvas as its tokens."""
    schedule = TINY_SCHEDULE.__class__(max_denoising_steps=10, t_min=0.4, t_max=0.8, entropy_bound=1.5,
                                       stability_threshold=stability, confidence_threshold=1.0)
    path = write_random_diffusion_gemma_checkpoint(tmp_path / "crafted", seed=2, schedule=schedule,
                                                   final_logit_softcapping=None)
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "experts.down_proj",
                          "self_conditioning.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.decoder.embed_tokens.weight"] *= 3
    weights["model.decoder.norm.weight"] = torch.ones_like(weights["model.decoder.norm.weight"])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    llm = engine(str(path))
    prompt = [65, 66, 67]
    out = llm.generate([prompt], SamplingParams(max_tokens=2 * CANVAS, seed=9, ignore_eos=True))[0]
    vocab = llm.model.arch.vocab_size
    starts = [mix32(noise_key(9 ^ 0x0C4A7A50, torch.arange(s, s + CANVAS), torch.zeros(CANVAS, dtype=torch.long)))
              % vocab for s in (3, 3 + CANVAS)]
    assert out.token_ids == torch.cat(starts).tolist()
    # The prompt is fed with the first canvas's first step, and each committed canvas with the next one's: every
    # forward is a denoising step.
    assert out.nfe == 2 * (stability + 1)


def test_requests_of_a_checkpoint_whose_forward_overflows_end_with_an_error_and_no_tokens(checkpoint, tmp_path):
    """Finite weights that overflow float32 in a forward (layer 0's gate and up projections ENORMOUS): every canvas's
    logits are NaN. Each request ends at its first sampler step with the error and no tokens, where it would
    otherwise stream the argmax of noise, and its pages are back in the pool."""
    path = tmp_path / "overflowing"
    shutil.copytree(checkpoint, path)
    weights = load_file(path / "model.safetensors")
    for name in ("model.decoder.layers.0.mlp.gate_proj.weight", "model.decoder.layers.0.mlp.up_proj.weight"):
        weights[name] = torch.full_like(weights[name], ENORMOUS)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    llm = engine(str(path), dtype="float32")
    streams = run_requests(llm, PROMPTS[:2], SamplingParams(max_tokens=2 * CANVAS, seed=3, ignore_eos=True))
    for stream in streams:
        (delta,) = stream.deltas
        assert (delta.token_ids, delta.finish_reason, delta.error) == ([], FinishReason.ERROR, NON_FINITE_ERROR)
    assert llm.metrics().kv_pages_used == 0


def test_a_canvas_whose_entropy_is_not_finite_ends_its_own_request_and_no_other(checkpoint, monkeypatch):
    """With one row of the second canvas of a step of two given a NaN entropy (as a NaN in its logits gives it),
    that canvas's request ends with the error and no tokens; the request of the first canvas decodes the tokens it
    decodes alone, and every page is back in the pool."""
    params = [SamplingParams(max_tokens=2 * CANVAS, seed=7 + i, ignore_eos=True) for i in range(2)]
    alone = [s.token_ids for s in run_one_at_a_time(engine(checkpoint), PROMPTS[:2], params)]
    sampled = strategy.chunked_row_statistics

    def second_of_two_poisoned(model, hidden, *args):
        stats = sampled(model, hidden, *args)
        if hidden.shape[0] == 2 * CANVAS:
            stats.entropy[CANVAS + 3] = float("nan")
        return stats

    monkeypatch.setattr(strategy, "chunked_row_statistics", second_of_two_poisoned)
    llm = engine(checkpoint)
    ids = [llm.add_request(prompt, p) for prompt, p in zip(PROMPTS[:2], params)]
    deltas = llm.step()
    plans = llm.last_schedule.plans
    assert len(plans) == 2 and all(plan.blocks for plan in plans)  # both canvases in the first step
    failed, kept = plans[1].request_id, plans[0].request_id
    assert [(d.request_id, d.token_ids, d.finish_reason, d.error) for d in deltas] == [
        (failed, [], FinishReason.ERROR, NON_FINITE_ERROR)]
    stream = Stream(kept)
    drain(llm, {kept: stream})
    assert stream.token_ids == alone[ids.index(kept)] and stream.finish_reason == FinishReason.LENGTH
    assert llm.metrics().kv_pages_used == 0


# --- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [("temperature", 0.7), ("top_k", 5), ("accept_threshold", 0.5),
                                         ("steps", 4)])
def test_request_settings_the_sampler_does_not_read_are_refused_by_name(checkpoint, name, value):
    llm = engine(checkpoint)
    with pytest.raises(Refusal, match=f"'{name}' does not apply to decoding_strategy 'diffusion_gemma'"):
        llm.prepare_request("hi", SamplingParams(max_tokens=4, **{name: value}))


def test_engine_settings_that_cannot_decode_it_are_refused(checkpoint):
    with pytest.raises(ValueError, match="block_size' must equal the checkpoint's canvas_length"):
        engine(checkpoint, block_size=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="decodes with decoding_strategy 'diffusion_gemma' only, got 'multi_bd'"):
        engine(checkpoint, decoding_strategy="multi_bd")
    with pytest.raises(ValueError, match="buffer_size' must be 1"):
        engine(checkpoint, buffer_size=2)
    for field, value in (("retention_ratio", 0.5), ("lora_modules", "a=/nowhere"), ("sampling_mode", "topk")):
        with pytest.raises(ValueError, match=f"config field '{field}'.*'diffusion_gemma'"):
            engine(checkpoint, **{field: value})
    with pytest.raises(ValueError, match="model 'diffusion_gemma' decodes"):
        Diffulex(checkpoint, **{**SETTINGS, "model_name": None, "decoding_strategy": "d2f",
                                "enable_prefix_caching": False})


@pytest.mark.parametrize("key, value, message", [
    ("num_kv_shared_layers", 2, "'num_kv_shared_layers' is 2"),
    ("tie_word_embeddings", False, "only a head tied to the embedding"),
    ("hidden_activation", "silu", "'hidden_activation' is 'silu'"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ("layer_types", ["sliding_attention"], "'layer_types' must list 4 entries"),
])
def test_config_values_selecting_math_not_built_are_refused_naming_the_key(checkpoint, tmp_path, key, value, message):
    path = tmp_path / "bad"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"][key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        engine(str(path))


def test_unknown_config_keys_load_with_a_warning_naming_them(checkpoint, tmp_path):
    path = tmp_path / "extra"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["a_new_bookkeeping_key"] = 1
    (path / "config.json").write_text(json.dumps(config))
    assert engine(str(path)).model.arch.unrecognized_config_keys == ("text_config.a_new_bookkeeping_key",)
