"""genai-perf, NVIDIA's benchmark client, measures the model through the OpenAI front in its OpenAI endpoint types:
completions on the random test model (synthetic prompts, the front's API key), chat on the demo model with
addition problems of the kind it was trained on."""

import json

from front_requests import API_KEY, DEMO_CHECKPOINT, DEMO_MODEL

from diffulex_client.perf.genai_perf import run_genai_perf


def measured(result) -> None:
    assert result.returncode == 0, result.output[-4000:]
    assert result.metrics["Request Count (count)"] >= 2
    assert result.metrics["Request Throughput (per sec)"] > 0
    assert result.output_tokens_avg is not None and result.output_tokens_avg > 0


def test_genai_perf_measures_completions_through_the_front(front, server, checkpoint, tmp_path):
    measured(run_genai_perf("completions", tmp_path, grpc_url=server.grpc_url, http_url=server.http_url,
                            openai_url=front.url.removeprefix("http://"), api_key=API_KEY, model="diffulex",
                            tokenizer=checkpoint, concurrency=2, measurement_interval_ms=2000, input_tokens=8,
                            output_tokens=8))


def test_genai_perf_measures_chat_through_the_front(demo_front, server, tmp_path):
    prompts = tmp_path / "additions.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"{a}+{b}="}) + "\n" for a, b in [(12, 34), (7, 8), (120, 5)]))
    measured(run_genai_perf("chat", tmp_path / "out", grpc_url=server.grpc_url, http_url=server.http_url,
                            openai_url=demo_front.url.removeprefix("http://"), model=DEMO_MODEL,
                            tokenizer=DEMO_CHECKPOINT, concurrency=2, measurement_interval_ms=2000, input_tokens=8,
                            output_tokens=8, input_file=prompts))
