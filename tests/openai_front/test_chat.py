"""Chat through the front: the demo model's shipped template renders a conversation as the bare problem the demo
was trained on, and a chat request gets the sum; a model without a template refuses chat and still completes."""

import sys
from pathlib import Path

import openai
import pytest
from front_requests import DEMO_CHECKPOINT, DEMO_MODEL, error_of

from diffulex_backend.tokenizer import load_tokenizer
from diffulex_client.openai_front.chat_template import ChatTemplate
from diffulex_client.openai_front.errors import OpenAIError
from diffulex_client.openai_front.schemas import ChatMessage

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from demo_task import TEST_SEED, held_out_problems  # noqa: E402


def messages(*pairs) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


def test_the_demo_template_renders_the_last_user_message_as_the_trained_prompt():
    template = ChatTemplate.load(DEMO_CHECKPOINT, None)
    conversation = messages(("system", "You add numbers."), ("user", "1+1="), ("assistant", "2"), ("user", " 12+34=\n"))
    assert template.render(conversation) == "12+34="
    # Token ids are the ASCII codes, with no BOS or other special token before or after.
    assert template.prompt_ids(conversation) == list(b"12+34=")
    assert load_tokenizer(DEMO_CHECKPOINT).encode("12+34=") == list(b"12+34=")


def test_content_parts_are_joined_and_other_parts_are_refused():
    template = ChatTemplate.load(DEMO_CHECKPOINT, None)
    parts = [ChatMessage(role="user", content=[{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}])]
    assert template.render(parts) == "12+34="
    image = [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])]
    with pytest.raises(OpenAIError, match="only text parts"):
        template.render(image)
    # A setting of a text part that nothing honours is refused by name, not dropped.
    cached = [ChatMessage(role="user", content=[{"type": "text", "text": "1+1=", "cache_control": {"type": "x"}}])]
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.content\[0\]\.cache_control is not supported") as caught:
        template.render(cached)
    assert caught.value.param == "messages[0].content[0].cache_control"


def test_a_template_file_overrides_the_tokenizers(tmp_path):
    override = tmp_path / "template.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert ChatTemplate.load(DEMO_CHECKPOINT, override).render(messages(("user", "hi"))) == "[user]hi"


def test_a_chat_request_gets_the_sum(demo_client):
    problems = [("12+34=", "46")] + [(p.prompt, p.answer) for p in held_out_problems(3, TEST_SEED)]
    for prompt, answer in problems:
        completion = demo_client.chat.completions.create(model=DEMO_MODEL,
                                                         messages=[{"role": "user", "content": prompt}])
        (choice,) = completion.choices
        assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", answer, "stop")
        assert completion.object == "chat.completion"
        assert completion.usage.prompt_tokens == len(prompt)
        assert completion.usage.completion_tokens >= len(answer)


def test_a_streamed_chat_starts_with_the_assistant_role_and_ends_with_done(demo_client):
    chunks = list(demo_client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "12+34="}], stream=True,
        stream_options={"include_usage": True}))
    *content, usage = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == "46"
    assert content[-1].choices[0].finish_reason == "stop"
    assert usage.choices == [] and usage.usage.prompt_tokens == 6
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_completions_on_the_demo_model_answer_too(demo_client):
    completion = demo_client.completions.create(model=DEMO_MODEL, prompt="7+8=")
    assert completion.choices[0].text == "15"


def test_a_model_without_a_template_refuses_chat_and_still_completes(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="diffulex", messages=[{"role": "user", "content": "hi"}])
    error = error_of(caught.value)
    assert error["code"] == "chat_template_missing" and "/v1/completions" in error["message"]
    assert client.completions.create(model="diffulex", prompt="hi", max_tokens=2).choices[0].text is not None


def test_an_unknown_role_is_a_400_naming_the_message(demo_client):
    with pytest.raises(openai.BadRequestError) as caught:
        demo_client.chat.completions.create(model=DEMO_MODEL, messages=[{"role": "wizard", "content": "1+1="}])
    assert error_of(caught.value)["param"] == "messages[0].role"


@pytest.mark.parametrize("fields, content, reason, choices", [
    ({}, "46", "stop", 1),
    ({"max_tokens": 1}, "4", "length", 1),
    ({"max_completion_tokens": 1, "max_tokens": 8}, "4", "length", 1),  # the newer field wins
    ({"stop": "6"}, "4", "stop", 1),
    ({"stop": ["x", "6"]}, "4", "stop", 1),
    ({"n": 3}, "46", "stop", 3),
], ids=str)
def test_each_honoured_chat_field_changes_the_answer_as_it_says(demo_client, fields, content, reason, choices):
    """Beside a 200 (tests/openai_front/test_request_fields.py), each field reaches the model: the demo answers
    12+34= with 46, greedily, and these fields cut or copy that answer."""
    completion = demo_client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "12+34="}], temperature=0, **fields)
    assert [(c.index, c.message.content, c.finish_reason) for c in completion.choices] == [
        (i, content, reason) for i in range(choices)]


def test_temperature_seed_and_top_p_each_change_the_chat_answer_as_they_say(demo_client):
    """The greedy demo answers 12+34= with 46. At temperature 5 its answers follow the seed: the same seed gives the
    same answer, and eight seeds give more than one; a top_p that keeps only the likeliest token gives 46 again
    whatever the seed and temperature."""
    def answer(**fields) -> str:
        return demo_client.chat.completions.create(
            model=DEMO_MODEL, messages=[{"role": "user", "content": "12+34="}], max_tokens=4, **fields,
        ).choices[0].message.content

    hot = [answer(temperature=5, seed=seed) for seed in range(8)]
    assert answer(temperature=5, seed=3) == hot[3]
    assert len(set(hot)) > 1
    assert {answer(temperature=5, top_p=1e-6, seed=seed) for seed in range(3)} == {"46"}
