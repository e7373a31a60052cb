"""The incremental detokenizer gives, block by block, the text of decoding each whole output, with three kinds of
real tokenizer: one token per byte (the test checkpoints'), a byte-level BPE with merges (GPT-2, Qwen, LLaDA), and
a SentencePiece-style BPE whose decoder strips the leading space of a text (Llama, Gemma): the case where decoding
the new tokens alone would give other text than decoding them after the ones before."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from diffulex_backend.output import Detokenizer
from diffulex_backend.testing.checkpoint import write_byte_tokenizer

CORPUS = ["Diffusion models decode a block of tokens at once, über schnell — 速い, très rapide.",
          "def step(self):\n    return [token for token in range(10)]  # a comment ✓", "naïve café 🙂 emoji"] * 20


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def metaspace_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                              show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module", params=["bytes", "byte_level_bpe", "metaspace_bpe"])
def tokenizer(request, tmp_path_factory):
    if request.param == "bytes":
        directory = tmp_path_factory.mktemp("bytes")
        write_byte_tokenizer(directory, 4096)
        return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    return byte_level_bpe() if request.param == "byte_level_bpe" else metaspace_bpe()


def blocks_of(ids: list[int], cuts: list[int]) -> list[list[int]]:
    cuts = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(cuts, cuts[1:])]


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(CORPUS[:3]) | st.text(max_size=60), cuts=st.lists(st.integers(0, 200), max_size=12),
       noise=st.lists(st.integers(0, 399), max_size=6))
def test_deltas_add_up_to_the_whole_outputs_text(tokenizer, text, cuts, noise):
    # Real text, and arbitrary ids too: a stream need not be text a tokenizer would make.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [i % len(tokenizer) for i in noise]
    blocks = blocks_of(ids, cuts)
    detokenizer, text_so_far = Detokenizer(tokenizer, stop=[]), ""
    for index, block in enumerate(blocks):
        delta, keep = detokenizer.add(block, final=index == len(blocks) - 1)
        assert keep is None
        text_so_far += delta
        whole = tokenizer.decode(ids[:sum(map(len, blocks[:index + 1]))], skip_special_tokens=True)
        assert whole.startswith(text_so_far) or index == len(blocks) - 1
    assert text_so_far == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12), stop=st.sampled_from(["once", "schnell", "✓", "速", "ü"]))
def test_a_stop_string_ends_the_text_where_decoding_the_whole_output_finds_it(tokenizer, cuts, stop):
    ids = tokenizer(CORPUS[0] + CORPUS[1], add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    detokenizer, text, kept = Detokenizer(tokenizer, stop=[stop]), "", []
    for block in blocks_of(ids, cuts):
        delta, keep = detokenizer.add(block, final=False)
        text += delta
        kept += block if keep is None else block[:keep]
        if keep is not None:
            break
    assert text == whole[:whole.index(stop)]
    # The tokens kept are the fewest whose text holds the stop string whole.
    through_stop = whole[:whole.index(stop) + len(stop)]
    assert tokenizer.decode(kept, skip_special_tokens=True).startswith(through_stop)
    assert not tokenizer.decode(kept[:-1], skip_special_tokens=True).startswith(through_stop)
