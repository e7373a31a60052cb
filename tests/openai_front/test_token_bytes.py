"""A token's bytes and a completion's text offsets in log-probabilities, with the byte-level tokenizer every test
checkpoint carries (a token per UTF-8 byte): a token that holds part of a character decodes alone to U+FFFD, yet its
bytes are its own, and its offset is the character's."""

from diffulex_backend.testing.checkpoint import byte_alphabet, write_random_checkpoint
from diffulex_backend.tokenizer import load_tokenizer
from diffulex_client.openai_front.responses import LogprobsFormat, TokenNames, TokenRun
from diffulex_client.openai_front.token_bytes import byte_level_bytes

TEXT = "a写b"  # 写 is E5 86 99 in UTF-8


def test_the_byte_level_alphabet_maps_each_character_to_its_byte():
    assert byte_level_bytes() == {char: byte for byte, char in enumerate(byte_alphabet())}


def test_a_token_inside_a_character_keeps_its_own_bytes_and_the_characters_offset(tmp_path):
    tokenizer = load_tokenizer(write_random_checkpoint(tmp_path / "model", "llada"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    names = TokenNames(tokenizer)
    assert [names(t) for t in ids] == ["a", "\ufffd", "\ufffd", "\ufffd", "b"]  # what decoding each alone gives
    assert [names.bytes_of(t) for t in ids] == [b"a", b"\xe5", b"\x86", b"\x99", b"b"]
    logprobs = LogprobsFormat(names)
    # Streamed in two chunks that cut the character: its last bytes come with the second.
    first = logprobs.completion(0, TokenRun(ids[:2], [-0.5, -1.0]))
    second = logprobs.completion(0, TokenRun(ids[2:], [-1.5, -2.0, -2.5]))
    assert first.text_offset + second.text_offset == [0, 1, 1, 1, 2]
    assert logprobs.completion(1, TokenRun(ids[4:], [-0.1])).text_offset == [0]  # another choice counts on its own
    chat = LogprobsFormat(names).chat(TokenRun(ids, [-0.5] * 5, [((t, -0.5),) for t in ids]))
    assert [token.bytes for token in chat.content] == [[0x61], [0xE5], [0x86], [0x99], [0x62]]
    assert bytes(b for token in chat.content for b in token.bytes).decode() == TEXT
    assert [top.bytes for token in chat.content for top in token.top_logprobs] == [t.bytes for t in chat.content]
