"""genai-perf, NVIDIA's benchmark client, runs against the real server in each of its Triton request shapes: the
vLLM backend's (string-valued sampling_parameters), TensorRT-LLM's (tensor inputs) and the generate endpoint."""

import sys

import pytest

from diffulex_client.perf import genai_perf
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


# A stand-in for genai-perf whose perf_analyzer leaves an empty export on the first run, as perf_analyzer 2.51 does
# when it reads a NaN out of an output a response left out (sweep.export_is_whole), and on which genai-perf fails;
# the second run measures. Each run appends a line to RUNS.
FAKE_GENAI_PERF = """#!{python}
import pathlib, sys
runs = pathlib.Path({runs!r})
runs.write_text(runs.read_text() + "run\\n" if runs.exists() else "run\\n")
run = pathlib.Path(sys.argv[sys.argv.index("--artifact-dir") + 1]) / "diffulex-triton-kserve"
run.mkdir(parents=True, exist_ok=True)
if len(runs.read_text().splitlines()) == 1:
    (run / "profile_export.json").write_text("")
    sys.exit("json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)")
(run / "profile_export.json").write_text('{{"experiments": []}}')
(run / "profile_export_genai_perf.csv").write_text("Metric,Value\\nRequest Count (count),4\\n")
"""


def test_a_run_whose_perf_analyzer_left_an_empty_export_is_made_again(tmp_path, monkeypatch):
    fake = tmp_path / "genai-perf"
    fake.write_text(FAKE_GENAI_PERF.format(python=sys.executable, runs=str(tmp_path / "runs")))
    fake.chmod(0o755)
    monkeypatch.setattr(genai_perf, "GENAI_PERF", fake)
    result = run_genai_perf("tensorrtllm", tmp_path / "artifacts", grpc_url="localhost:1", http_url="localhost:2",
                            model="diffulex", tokenizer=tmp_path, concurrency=2, measurement_interval_ms=2000,
                            input_tokens=8, output_tokens=8)
    assert result.returncode == 0 and result.metrics == {"Request Count (count)": 4}
    assert len((tmp_path / "runs").read_text().splitlines()) == 2
