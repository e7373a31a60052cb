"""/v1/completions through the real front and tritonserver, with the official openai client, against the same
checkpoint run in this process: the same tokens, whatever way they are asked for."""

import openai
import pytest
from front_requests import error_of

from diffulex_backend import SamplingParams

PROMPT = "hello"


def reference(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**params))[0]


def test_a_greedy_completion_is_the_engines_text_with_its_counts(client, engine):
    expected = reference(engine, PROMPT, max_tokens=12, temperature=0)
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=12, temperature=0)
    (choice,) = completion.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, expected.text, expected.finish_reason.value)
    assert completion.object == "text_completion" and completion.model == "diffulex"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        len(expected.prompt_token_ids), len(expected.token_ids),
        len(expected.prompt_token_ids) + len(expected.token_ids))


def test_a_streamed_completion_sends_a_chunk_per_block_then_usage_and_done(client, engine):
    expected = reference(engine, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    chunks = list(client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *blocks, last = chunks
    assert len(blocks) == 3  # 12 tokens in blocks of 4
    assert "".join(c.choices[0].text for c in blocks) == expected.text
    assert [c.choices[0].finish_reason for c in blocks] == [None, None, "length"]
    assert all(c.usage is None for c in blocks)
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_a_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert all(chunk.choices for chunk in chunks)


def test_n_choices_are_the_seed_plus_i_requests(client, engine):
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=8, temperature=1, seed=41, n=3)
    expected = [reference(engine, PROMPT, max_tokens=8, temperature=1, seed=41 + i).text for i in range(3)]
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.text for c in completion.choices] == expected
    assert completion.usage.prompt_tokens == len(reference(engine, PROMPT, max_tokens=1).prompt_token_ids)


def test_the_seed_wraps_modulo_two_to_the_64(client, engine):
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=8, temperature=1,
                                           seed=2**64 - 1, n=2)
    expected = [reference(engine, PROMPT, max_tokens=8, temperature=1, seed=s).text for s in (2**64 - 1, 0)]
    assert [c.text for c in completion.choices] == expected


def test_the_same_seed_at_temperature_one_gives_the_same_text_twice(client):
    texts = [client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=12, temperature=1, seed=7)
             .choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    other = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=12, temperature=1, seed=8)
    assert other.choices[0].text != texts[0]


def test_streamed_n_choices_arrive_under_their_indexes(client, engine):
    chunks = list(client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=8, temperature=1, seed=3, n=2,
                                            stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert texts == {i: reference(engine, PROMPT, max_tokens=8, temperature=1, seed=3 + i).text for i in range(2)}


def test_a_stop_string_ends_the_text_as_the_engine_ends_it(client, engine):
    full = reference(engine, PROMPT, max_tokens=16, temperature=0, ignore_eos=True).text
    stop = full[5:7]
    expected = reference(engine, PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                           extra_body={"ignore_eos": True})
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (expected.text, "stop")
    assert stop not in completion.choices[0].text


def test_token_id_prompts_and_prompt_lists_index_choices_per_prompt(client, engine):
    ids = [reference(engine, p, max_tokens=1).prompt_token_ids for p in (PROMPT, "bye")]
    expected = [reference(engine, p, max_tokens=6, temperature=0).text for p in (PROMPT, "bye")]
    for prompt in (ids, [PROMPT, "bye"]):
        completion = client.completions.create(model="diffulex", prompt=prompt, max_tokens=6, temperature=0, n=2)
        assert [(c.index, c.text) for c in completion.choices] == [
            (0, expected[0]), (1, expected[0]), (2, expected[1]), (3, expected[1])]
    single = client.completions.create(model="diffulex", prompt=ids[0], max_tokens=6, temperature=0)
    assert single.choices[0].text == expected[0]


def test_the_models_own_settings_come_as_extra_body_fields(client, engine):
    params = {"ignore_eos": True, "top_k": 3, "confidence": "margin", "accept_threshold": 0.5}
    expected = reference(engine, PROMPT, max_tokens=10, temperature=1, seed=5, **params)
    completion = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=10, temperature=1, seed=5,
                                           extra_body=params)
    assert completion.choices[0].text == expected.text
    assert (completion.usage.completion_tokens, completion.choices[0].finish_reason) == (10, "length")


@pytest.mark.parametrize("extra, param", [({"top_k": -1}, "top_k"), ({"confidence": "vibes"}, "confidence")])
def test_a_value_the_model_refuses_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=4, extra_body=extra)
    error = error_of(caught.value)
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert param in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_ban_that_leaves_no_token_to_sample_is_a_400_naming_stop_token_ids(client, engine, stream):
    """Stop ids that are every token but the mask token, under min_tokens, leave the first positions nothing to
    sample; the model refuses them, and the front answers 400 naming the parameter, streamed or not, where it once
    answered a 500 (and NaN log-probabilities in the stream)."""
    vocab, mask = engine.model.arch.vocab_size, engine.config.mask_token_id
    every = [t for t in range(vocab) if t != mask]
    with pytest.raises(openai.BadRequestError) as caught:
        response = client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=4, logprobs=2, stream=stream,
                                             extra_body={"min_tokens": 4, "stop_token_ids": every})
        if stream:
            list(response)
    error = error_of(caught.value)
    assert (error["param"], error["type"]) == ("stop_token_ids", "invalid_request_error")
    assert "leaves no token to sample" in error["message"]
    expected = reference(engine, PROMPT, max_tokens=6, temperature=0)
    assert client.completions.create(model="diffulex", prompt=PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text == expected.text


def test_an_unknown_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert error_of(caught.value)["code"] == "model_not_found"


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == ["diffulex"]
