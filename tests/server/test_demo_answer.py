"""What `make serve` serves: the shipped config.pbtxt with the shipped demo checkpoint answers additions through
a real tritonserver."""

import sys
from pathlib import Path

from served import generate, load_shipped, post

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from demo_task import TEST_SEED, held_out_problems  # noqa: E402

DEMO = "diffulex_demo"


def answers(server, model: str, problems: list[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Each prompt's (text, finish reason) as the model serves it."""
    body = {"exclude_input_in_output": True, "return_finish_reason": True}
    served = {prompt: generate(server, {**body, "text_input": prompt}, model=model) for prompt, _ in problems}
    return {prompt: (r["text_output"], r["finish_reason"]) for prompt, r in served.items()}


def additions(count: int) -> list[tuple[str, str]]:
    return [("12+34=", "46")] + [(p.prompt, p.answer) for p in held_out_problems(count - 1, TEST_SEED)]


def test_the_shipped_model_answers_additions_with_its_default_settings(server):
    load_shipped(server, DEMO)
    try:
        problems = additions(6)
        assert answers(server, DEMO, problems) == {prompt: (answer, "stop") for prompt, answer in problems}
    finally:
        post(f"{server.http_url}/v2/repository/models/{DEMO}/unload", {})
