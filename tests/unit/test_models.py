"""Each family's forward against a dense reference written here from the checkpoint's own tensors.

The reference reads config.json and the safetensors by their released names and does plain matmuls and a
softmax; it shares no code with the model, so a wrong weight mapping, norm, bias or rotation shows up.
"""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.testing.checkpoint import RELEASED_SHAPES, write_random_checkpoint
from diffulex_backend.loader import load_model
from diffulex_backend.models import DecoderLM
from diffulex_backend.registry import AutoModelForDiffusionLM
from released_configs import DREAM_V0_INSTRUCT_7B, LLADA_8B_INSTRUCT, SDAR_1_7B_CHAT

FAMILIES = ["llada", "dream", "sdar"]

# --- config.json of released checkpoints, as published (released_configs.py) -------------------------------

RELEASED_CONFIGS = {"llada": LLADA_8B_INSTRUCT, "dream": DREAM_V0_INSTRUCT_7B, "sdar": SDAR_1_7B_CHAT}

# --- the dense reference -----------------------------------------------------------------------------------

LLADA_NAMES = dict(
    embed="model.transformer.wte.weight", final_norm="model.transformer.ln_f.weight",
    head="model.transformer.ff_out.weight", layer="model.transformer.blocks.{}.", attn_norm="attn_norm",
    q="q_proj", k="k_proj", v="v_proj", o="attn_out", mlp_norm="ff_norm", gate="ff_proj", up="up_proj",
    down="ff_out", q_norm=None, k_norm=None,
)
QWEN_NAMES = dict(
    embed="model.embed_tokens.weight", final_norm="model.norm.weight", head="lm_head.weight",
    layer="model.layers.{}.", attn_norm="input_layernorm", q="self_attn.q_proj", k="self_attn.k_proj",
    v="self_attn.v_proj", o="self_attn.o_proj", mlp_norm="post_attention_layernorm", gate="mlp.gate_proj",
    up="mlp.up_proj", down="mlp.down_proj", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
)


def dims(cfg):
    if cfg["model_type"] == "llada":
        hidden, heads = cfg["d_model"], cfg["n_heads"]
        return dict(layers=cfg["n_layers"], heads=heads, kv_heads=cfg["n_kv_heads"], head_dim=hidden // heads,
                    eps=cfg["rms_norm_eps"], theta=cfg["rope_theta"], tied=cfg["weight_tying"], names=LLADA_NAMES,
                    qkv_bias=False, qk_norm=False)
    heads = cfg["num_attention_heads"]
    return dict(layers=cfg["num_hidden_layers"], heads=heads, kv_heads=cfg["num_key_value_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, eps=cfg["rms_norm_eps"],
                theta=cfg["rope_theta"], tied=cfg["tie_word_embeddings"], names=QWEN_NAMES,
                qkv_bias=cfg["model_type"] == "Dream", qk_norm=cfg["model_type"] == "sdar")


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):  # x [T, heads, d]
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def dense_forward(directory, input_ids, positions, visible):
    """Final-norm hidden states and logits; visible[i, j]: query i may attend to key j."""
    cfg = json.loads((directory / "config.json").read_text())
    w = load_file(directory / "model.safetensors")
    d = dims(cfg)
    n = d["names"]
    tokens = len(input_ids)
    x = w[n["embed"]][input_ids]
    for layer in range(d["layers"]):
        p = n["layer"].format(layer)

        def proj(name, h, bias=False):
            out = h @ w[f"{p}{name}.weight"].T
            return out + w[f"{p}{name}.bias"] if bias else out

        h = rms(x, w[f"{p}{n['attn_norm']}.weight"], d["eps"])
        q = proj(n["q"], h, d["qkv_bias"]).view(tokens, d["heads"], d["head_dim"])
        k = proj(n["k"], h, d["qkv_bias"]).view(tokens, d["kv_heads"], d["head_dim"])
        v = proj(n["v"], h, d["qkv_bias"]).view(tokens, d["kv_heads"], d["head_dim"])
        if d["qk_norm"]:
            q = rms(q, w[f"{p}{n['q_norm']}.weight"], d["eps"])
            k = rms(k, w[f"{p}{n['k_norm']}.weight"], d["eps"])
        q, k = rope(q, positions, d["theta"]), rope(k, positions, d["theta"])
        group = d["heads"] // d["kv_heads"]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d["head_dim"])
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        attn = torch.einsum("hts,shd->thd", probs, v).reshape(tokens, -1)
        x = x + proj(n["o"], attn)
        h = rms(x, w[f"{p}{n['mlp_norm']}.weight"], d["eps"])
        x = x + proj(n["down"], torch.nn.functional.silu(proj(n["gate"], h)) * proj(n["up"], h))
    hidden = rms(x, w[n["final_norm"]], d["eps"])
    head = w[n["embed"]] if d["tied"] else w[n["head"]]
    return hidden, hidden @ head.T


def assert_matches(actual, expected):
    """Equal to 1e-5 of the tensor's scale: float32 GEMMs of a fused and a split projection round differently."""
    assert actual.shape == expected.shape
    error, scale = (actual - expected).abs().max().item(), max(1.0, expected.abs().max().item())
    assert error <= 1e-5 * scale, f"max error {error:.3g} at scale {scale:.3g}"


def single_sequence_meta(tokens, block_ids, *, context_len=0, page_table=(-1,), slot_mapping=None):
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
        context_lens=torch.tensor([context_len], dtype=torch.int32),
        page_tables=torch.tensor([list(page_table)], dtype=torch.int32),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.long) if slot_mapping is None else slot_mapping,
        block_ids=torch.as_tensor(block_ids, dtype=torch.int32),
        max_seqlen_q=tokens,
        max_context_len=context_len,
        cu_seqlens_q_host=(0, tokens),
        context_lens_host=(context_len,),
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    # GQA (4 heads over 2 kv heads) and, for SDAR, a head_dim that is not hidden // heads.
    return {
        name: write_random_checkpoint(
            tmp_path_factory.mktemp(name), name, seed=3, **({"head_dim": 8} if name == "sdar" else {})
        )
        for name in FAMILIES
    }


def random_ids(count, seed):
    return torch.randint(0, 258, (count,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", FAMILIES)
def test_full_attention_forward_matches_dense_reference(checkpoints, name):
    model = load_model(checkpoints[name])
    tokens = 24
    ids, positions = random_ids(tokens, 1), torch.arange(tokens)
    with torch.inference_mode():
        hidden = model(ids, positions, single_sequence_meta(tokens, torch.zeros(tokens)), None)
        logits = model.compute_logits(hidden)
    ref_hidden, ref_logits = dense_forward(checkpoints[name], ids, positions, torch.ones(tokens, tokens, dtype=torch.bool))
    assert_matches(hidden, ref_hidden)
    assert_matches(logits, ref_logits)
    assert logits.shape == (tokens, 258)


@pytest.mark.parametrize("name,tie_key", [("llada", "weight_tying"), ("dream", "tie_word_embeddings")])
def test_tied_checkpoint_has_no_head_and_scores_with_the_embedding(tmp_path, name, tie_key):
    directory = write_random_checkpoint(tmp_path, name, num_layers=1, **{tie_key: True})
    names = load_file(directory / "model.safetensors").keys()
    assert not any(n in names for n in ("lm_head.weight", "model.transformer.ff_out.weight"))
    model = load_model(directory)
    ids, positions = random_ids(8, 2), torch.arange(8)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, single_sequence_meta(8, torch.zeros(8)), None))
    _, ref_logits = dense_forward(directory, ids, positions, torch.ones(8, 8, dtype=torch.bool))
    assert_matches(logits, ref_logits)


def slots(page_table, positions, page_size):
    return torch.tensor([page_table[p // page_size] * page_size + p % page_size for p in positions])


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_prefix_plus_new_blocks_equals_dense_forward_with_the_same_mask(checkpoints, name):
    """Step 1 stores a causal prompt's K/V in scattered pages; step 2 feeds two blocks that read it back."""
    model = load_model(checkpoints[name])
    arch = model.arch
    page_size, prompt, new = 4, 10, 6
    page_table = (5, 2, 7, 1)
    kv_cache = torch.zeros(2, arch.num_layers, 8, page_size, arch.num_kv_heads, arch.head_dim)
    ids = random_ids(prompt + new, 4)
    block_ids = torch.cat([torch.arange(prompt), torch.tensor([10, 10, 10, 13, 13, 13])])
    with torch.inference_mode():
        prefill = model(ids[:prompt], torch.arange(prompt), single_sequence_meta(
            prompt, block_ids[:prompt], page_table=page_table,
            slot_mapping=slots(page_table, range(prompt), page_size)), kv_cache)
        blocks = model(ids[prompt:], torch.arange(prompt, prompt + new), single_sequence_meta(
            new, block_ids[prompt:], context_len=prompt, page_table=page_table), kv_cache)
    visible = block_ids[None, :] <= block_ids[:, None]  # causal prompt, block-causal blocks, all see the prompt
    ref_hidden, _ = dense_forward(checkpoints[name], ids, torch.arange(prompt + new), visible)
    assert_matches(prefill, ref_hidden[:prompt])
    assert_matches(blocks, ref_hidden[prompt:])
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[list(page_table[:3])] = False
    assert kv_cache[:, :, untouched].abs().sum() == 0  # K/V went only to the prompt's pages


def test_two_sequences_in_one_forward_equal_each_alone(checkpoints):
    model = load_model(checkpoints["sdar"])
    a, b = random_ids(5, 5), random_ids(7, 6)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
        context_lens=torch.zeros(2, dtype=torch.int32),
        page_tables=torch.full((2, 1), -1, dtype=torch.int32),
        slot_mapping=torch.full((12,), -1, dtype=torch.long),
        block_ids=torch.zeros(12, dtype=torch.int32),
        max_seqlen_q=7, max_context_len=0, cu_seqlens_q_host=(0, 5, 12), context_lens_host=(0, 0),
    )
    with torch.inference_mode():
        both = model(torch.cat([a, b]), torch.cat([torch.arange(5), torch.arange(7)]), meta, None)
        alone_a = model(a, torch.arange(5), single_sequence_meta(5, torch.zeros(5)), None)
        alone_b = model(b, torch.arange(7), single_sequence_meta(7, torch.zeros(7)), None)
    assert_matches(both, torch.cat([alone_a, alone_b]))


@pytest.mark.parametrize("name", FAMILIES)
def test_released_config_parses_to_its_architecture(name):
    cfg = RELEASED_CONFIGS[name]
    arch = AutoModelForDiffusionLM.get(name).parse_config(cfg, "config.json")
    expected = {
        "llada": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                      intermediate_size=12288, vocab_size=126464, mask_token_id=126336, eos_token_ids=(126081,),
                      rope_theta=500000.0, max_position_embeddings=4096, shifted=False, block_size=None,
                      qkv_bias=False, qk_norm=False, tie_word_embeddings=False),
        "dream": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                      intermediate_size=18944, vocab_size=152064, mask_token_id=151666, eos_token_ids=(151643,),
                      rope_theta=1e6, max_position_embeddings=131072, shifted=True, block_size=None,
                      qkv_bias=True, qk_norm=False, tie_word_embeddings=False),
        "sdar": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                     intermediate_size=6144, vocab_size=151936, mask_token_id=151669, eos_token_ids=(151643,),
                     rope_theta=1e6, max_position_embeddings=32768, shifted=False, block_size=4,
                     qkv_bias=False, qk_norm=True, tie_word_embeddings=False),
    }[name]
    assert {key: getattr(arch, key) for key in expected} == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_written_config_has_the_released_key_set(checkpoints, name):
    written = json.loads((checkpoints[name] / "config.json").read_text())
    assert set(written) == set(RELEASED_CONFIGS[name])


@pytest.mark.parametrize("shape", sorted(RELEASED_SHAPES))
def test_num_params_counts_every_parameter(shape):
    spec = dict(RELEASED_SHAPES[shape])
    name = spec.pop("model_name")
    from diffulex_backend.testing.checkpoint import random_config

    family = AutoModelForDiffusionLM.get(name)
    arch = family.parse_config(random_config(name, **spec), "config.json")
    with torch.device("meta"):
        model: DecoderLM = family(arch, None)
    assert arch.num_params() == sum(p.numel() for p in model.parameters())
    if shape == "llada-8b":
        assert arch.num_params() == 8_015_581_184  # "8.02 B"
