"""The random-checkpoint writer, its byte-level tokenizer, and mask/EOS resolution."""
import dataclasses
import json

import pytest
import torch

from diffulex_backend.attention import AttentionMetadata
from diffulex_backend.testing.checkpoint import (
    EOS_TOKEN_ID, MASK_TOKEN_ID, main, random_model, write_random_checkpoint,
)
from diffulex_backend.loader import CheckpointError, load_model
from diffulex_backend.tokenizer import load_tokenizer, resolve_eos_token_ids, resolve_mask_token_id


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("dream"), "dream", seed=5)


@pytest.mark.parametrize("text", ["12+34=46", "héllo wörld", "你好，世界", "emoji 🙂 and\ttabs\nnewlines  ", ""])
def test_tokenizer_round_trips_utf8_text_one_token_per_byte(dream_dir, text):
    tokenizer = load_tokenizer(dream_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # multi-byte characters span several tokens
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_that_config_json_names(dream_dir):
    tokenizer = load_tokenizer(dream_dir)
    config = json.loads((dream_dir / "config.json").read_text())
    assert tokenizer.encode("ab<|mdm_mask|><|endoftext|>", add_special_tokens=False) == [97, 98, 257, 256]
    assert (tokenizer.mask_token_id, tokenizer.eos_token_id) == (MASK_TOKEN_ID, EOS_TOKEN_ID)
    assert (config["mask_token_id"], config["eos_token_id"]) == (MASK_TOKEN_ID, EOS_TOKEN_ID)
    assert tokenizer.decode([104, 105, 256], skip_special_tokens=True) == "hi"


def test_mask_id_comes_from_config_then_from_the_tokenizer(dream_dir):
    arch, tokenizer = load_model(dream_dir).arch, load_tokenizer(dream_dir)
    assert resolve_mask_token_id(dataclasses.replace(arch, mask_token_id=3), tokenizer) == 3
    assert resolve_mask_token_id(dataclasses.replace(arch, mask_token_id=None), tokenizer) == MASK_TOKEN_ID
    tokenizer.mask_token = None
    with pytest.raises(ValueError, match="model 'dream': no mask token: config.json has no 'mask_token_id' and the"
                                         " tokenizer defines no mask_token; set mask_token_id"):
        resolve_mask_token_id(dataclasses.replace(arch, mask_token_id=None), tokenizer)


def test_eos_ids_are_the_config_ones_then_the_tokenizer_one(dream_dir):
    arch, tokenizer = load_model(dream_dir).arch, load_tokenizer(dream_dir)
    assert resolve_eos_token_ids(arch, tokenizer) == (EOS_TOKEN_ID,)
    assert resolve_eos_token_ids(dataclasses.replace(arch, eos_token_ids=(7, 256)), tokenizer) == (7, 256)
    assert resolve_eos_token_ids(dataclasses.replace(arch, eos_token_ids=(7,)), tokenizer) == (7, EOS_TOKEN_ID)


def test_missing_tokenizer_names_the_directory(tmp_path):
    directory = write_random_checkpoint(tmp_path, "llada", num_layers=1, tokenizer=False)
    with pytest.raises(CheckpointError, match=f"{directory}: no tokenizer files"):
        load_tokenizer(directory)


def test_tokenizer_with_a_remote_code_class_falls_back_to_tokenizer_json(tmp_path):
    directory = write_random_checkpoint(tmp_path, "dream", num_layers=1)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="DreamTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]})
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(directory)
    assert tokenizer.encode("é<|mdm_mask|>", add_special_tokens=False) == [195, 169, MASK_TOKEN_ID]


def test_random_model_holds_the_weights_the_writer_writes(tmp_path):
    written = load_model(write_random_checkpoint(tmp_path, "sdar", seed=9, block_size=8))
    built = random_model("sdar", seed=9, block_size=8)
    assert written.arch == built.arch and written.arch.block_size == 8
    for (name, a), b in zip(written.state_dict().items(), built.state_dict().values()):
        assert torch.equal(a, b), name


def test_greedy_confidences_of_masked_positions_spread_across_thresholds():
    model = random_model("llada", seed=0)
    ids = torch.cat([torch.arange(32, 64), torch.full((32,), MASK_TOKEN_ID)])
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 64], dtype=torch.int32), context_lens=torch.tensor([0], dtype=torch.int32),
        page_tables=torch.tensor([[-1]], dtype=torch.int32), slot_mapping=torch.full((64,), -1),
        block_ids=torch.zeros(64, dtype=torch.int32), max_seqlen_q=64, max_context_len=0,
        cu_seqlens_q_host=(0, 64), context_lens_host=(0,),
    )
    with torch.inference_mode():
        confidence = model.compute_logits(model(ids, torch.arange(64), meta, None)).softmax(-1).max(-1).values
    masked = confidence[32:]
    assert masked.min() < 0.5 and masked.max() > 0.9


def test_cli_writes_a_loadable_checkpoint_with_config_overrides(tmp_path, capsys):
    main([str(tmp_path / "out"), "--model-name", "sdar", "--hidden-size", "32", "--num-layers", "1",
          "--dtype", "bfloat16", "--num-shards", "2", "--set", "block_size=16", "--set", "tie_word_embeddings=true"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    arch = load_model(tmp_path / "out").arch
    assert (arch.hidden_size, arch.num_layers, arch.block_size, arch.tie_word_embeddings) == (32, 1, 16, True)
    assert load_tokenizer(tmp_path / "out").decode([104, 105]) == "hi"


def test_writer_keeps_a_config_key_the_family_does_not_read_and_the_loader_names_it(tmp_path):
    write_random_checkpoint(tmp_path, "llada", block_size=4)
    assert json.loads((tmp_path / "config.json").read_text())["block_size"] == 4
    assert load_model(tmp_path).arch.unrecognized_config_keys == ("block_size",)


def test_writer_rejects_a_head_dim_the_family_cannot_express(tmp_path):
    with pytest.raises(ValueError, match="llada: head_dim is d_model // n_heads; it cannot be set on its own"):
        write_random_checkpoint(tmp_path, "llada", head_dim=8)
