"""logprobs through the real front and tritonserver with the official openai client: the engine's numbers in
OpenAI's shapes, streamed and not; bad values are a 400 that names the field; n copies share the prompt's pages."""

import openai
import pytest
import time

from front_requests import error_of, prefix_cache_tokens

from diffulex_backend import SamplingParams

PROMPT = "hello"
# The server's engine and the reference run float32 in two processes, whose reductions may round differently.
CLOSE = {"rel": 1e-5, "abs": 1e-5}


def reference(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**params))[0]


def name(token_id: int) -> str:  # the random model's front runs without --tokenizer
    return f"token_id:{token_id}"


def test_completion_logprobs_are_the_engines_with_the_top_tokens(client, engine):
    expected = reference(engine, PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [name(t) for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs, **CLOSE)
    assert [list(row) for row in logprobs.top_logprobs] == [[name(t) for t in row] for row in expected.top_logprobs]
    assert [v for row in logprobs.top_logprobs for v in row.values()] == pytest.approx(
        [v for row in expected.top_logprobs for v in row.values()], **CLOSE)
    assert logprobs.text_offset == [sum(len(name(u)) for u in expected.token_ids[:i])
                                    for i in range(len(expected.token_ids))]


def test_streamed_completion_logprobs_come_with_each_chunk(client, engine):
    expected = reference(engine, PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    chunks = list(client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) == 3  # a chunk per block of 4
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == [name(t) for t in expected.token_ids]
    assert values == pytest.approx(expected.logprobs, **CLOSE)
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(set(offsets)) == 12  # running on across chunks
    assert all(c.choices[0].logprobs.top_logprobs is None for c in chunks)


def test_a_completion_without_logprobs_has_none(client):
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=4, temperature=0)
    assert completion.choices[0].logprobs is None


def test_a_completions_offsets_and_top_rows_follow_its_text_with_a_tokenizer(demo_client):
    """With the demo's tokenizer: the EOS token, which the text leaves out, adds nothing to the offsets, so none
    points past the text; and alternatives whose texts are the same (byte tokens that decode to U+FFFD) share a name
    that keeps the most likely one's log-probability, so each row's values fall in the order of the model's."""
    completion = demo_client.completions.create(model="diffulex_openai_demo", prompt="12+34=", max_tokens=8,
                                                temperature=0, logprobs=20, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert "<|endoftext|>" in logprobs.tokens and "<|endoftext|>" not in choice.text  # the case at hand
    texts = ["" if token == "<|endoftext|>" else token for token in logprobs.tokens]
    assert "".join(texts) == choice.text
    assert logprobs.text_offset == [len("".join(texts[:i])) for i in range(len(texts))]
    assert all(offset <= len(choice.text) for offset in logprobs.text_offset)
    rows = [list(row.values()) for row in logprobs.top_logprobs]
    assert any(len(row) < 20 for row in rows)  # some row holds alternatives of the same text
    assert all(row == sorted(row, reverse=True) for row in rows), rows


def test_chat_logprobs_are_per_token_with_top_logprobs(demo_client):
    body = dict(model="diffulex_openai_demo", messages=[{"role": "user", "content": "1+2="}], max_tokens=8,
                temperature=0)
    chat = demo_client.chat.completions.create(**body, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy
    assert all(t.bytes == list(t.token.encode()) and t.logprob <= 0 for t in content)
    streamed = list(demo_client.chat.completions.create(**body, logprobs=True, stream=True))
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [(t.token, t.logprob, t.top_logprobs) for t in tokens] == [(t.token, t.logprob, []) for t in content]
    assert demo_client.chat.completions.create(**body).choices[0].logprobs is None


@pytest.mark.parametrize("endpoint, body, param, message", [
    ("completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", "'logprobs' must be an integer in [0, 20], got 21"),
    ("completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs", "'logprobs' must be an integer in [0, 20], got -1"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "'top_logprobs' must be an integer in [0, 20], got 21"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs",
     "'top_logprobs' needs 'logprobs' to be true"),
])
def test_a_bad_logprobs_value_is_a_400_naming_it(client, endpoint, body, param, message):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        create(model="diffulex", max_tokens=4, **body)
    error = error_of(caught.value)
    assert (error["param"], error["message"]) == (param, message)


def test_n_copies_share_the_prompts_pages(client, server, engine):
    """The model's prefix-cache hit counter rises by the prompt's pages times n - 1 for one request of n choices."""
    prompt, n = "#n-copies# a prompt long enough to fill a good number of pages of four tokens", 4  # shares no page
    hits, queried = prefix_cache_tokens(server)
    completion = client.completions.create(model="diffulex", prompt=prompt, max_tokens=8, temperature=0, n=n)
    assert len({c.text for c in completion.choices}) == 1
    page_tokens = (len(engine.tokenizer.encode(prompt)) - 1) // 4 * 4  # the last prompt token is always recomputed
    deadline = time.monotonic() + 10
    while prefix_cache_tokens(server)[1] - queried < n * page_tokens and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefix_cache_tokens(server) == (hits + (n - 1) * page_tokens, queried + n * page_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_alternatives_that_could_not_be_sampled_are_the_floor_whole_and_streamed(client, engine, stream):
    """Two tokens left to sample and five alternatives asked for: the other three come as -9999.0, as OpenAI and vLLM
    send a log-probability of minus infinity, and the response parses, whole and streamed; the two that could be
    sampled are the engine's."""
    vocab, mask = engine.model.arch.vocab_size, engine.config.mask_token_id
    ban = {"min_tokens": 4, "ignore_eos": True,
           "stop_token_ids": [t for t in range(vocab) if t not in (5, 6) and t != mask]}
    expected = reference(engine, PROMPT, max_tokens=4, temperature=0, logprobs=5, **ban)
    response = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=5,
                                         stream=stream, extra_body=ban)
    rows = [row for chunk in (response if stream else [response]) for row in chunk.choices[0].logprobs.top_logprobs]
    assert len(rows) == 4
    for row, want in zip(rows, expected.top_logprobs):
        values = list(row.values())
        assert len(row) == 5 and [row[name(5)], row[name(6)]] == pytest.approx([want[5], want[6]], **CLOSE)
        assert sorted(values)[:3] == [-9999.0] * 3
