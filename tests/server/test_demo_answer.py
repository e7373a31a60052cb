"""What `make serve` serves: the shipped config.pbtxt with the shipped demo checkpoint answers additions through
a real tritonserver."""

import base64
import json
import sys
import urllib.request
from pathlib import Path

from served import post
from triton_server import SHIPPED_MODEL, with_parameters
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from demo_task import TEST_SEED, held_out_problems  # noqa: E402

DEMO = "diffulex_demo"


def load_shipped_model(server) -> None:
    """Load the shipped config and model.py under another name, through the load API's file override; only the
    checkpoint path changes, to the absolute path of the shipped demo model."""
    config_text = with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), DEMO,
                                  model=SHIPPED_MODEL / "demo-llada")
    config = json_format.MessageToJson(text_format.Parse(config_text, model_config_pb2.ModelConfig()))
    model_file = base64.b64encode((SHIPPED_MODEL / "1" / "model.py").read_bytes()).decode()
    status, payload = post(f"{server.http_url}/v2/repository/models/{DEMO}/load",
                           {"parameters": {"config": config, "file:1/model.py": model_file}})
    assert status == 200, payload


def generate(server, prompt: str) -> dict:
    body = {"text_input": prompt, "exclude_input_in_output": True, "return_finish_reason": True}
    request = urllib.request.Request(f"{server.http_url}/v2/models/{DEMO}/generate", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_the_shipped_model_answers_additions_with_its_default_settings(server):
    load_shipped_model(server)
    try:
        problems = [("12+34=", "46")] + [(p.prompt, p.answer) for p in held_out_problems(5, TEST_SEED)]
        answers = {prompt: generate(server, prompt) for prompt, _ in problems}
        assert {prompt: (r["text_output"], r["finish_reason"]) for prompt, r in answers.items()} == {
            prompt: (answer, "stop") for prompt, answer in problems
        }
    finally:
        post(f"{server.http_url}/v2/repository/models/{DEMO}/unload", {})
