"""genai-perf, NVIDIA's benchmark client, runs against the real server in each of its Triton request shapes: the
vLLM backend's (string-valued sampling_parameters), TensorRT-LLM's (tensor inputs) and the generate endpoint."""

import pytest

from diffulex_client.perf.genai_perf import run_genai_perf


@pytest.mark.parametrize("mode", ["vllm", "tensorrtllm", "generate"])
def test_genai_perf_measures_the_model_in_each_request_shape(server, checkpoint, tmp_path, mode):
    result = run_genai_perf(mode, tmp_path, grpc_url=server.grpc_url, http_url=server.http_url, model="diffulex",
                            tokenizer=checkpoint, concurrency=2, measurement_interval_ms=2000, input_tokens=8,
                            output_tokens=8)
    assert result.returncode == 0, result.output[-4000:]
    assert result.metrics["Request Count (count)"] >= 2
    assert result.metrics["Request Throughput (per sec)"] > 0
    assert result.output_tokens_avg is not None and result.output_tokens_avg > 0
    if mode != "generate":
        # These modes send min_tokens = max_tokens (min_length for TensorRT-LLM's shape): EOS cannot cut an answer
        # short. genai-perf counts by tokenizing the text again, and the random model's bytes decode to replacement
        # characters that tokenize longer, so it counts at least the 8 tokens asked for.
        assert result.output_tokens_avg >= 8, result.output[-4000:]
