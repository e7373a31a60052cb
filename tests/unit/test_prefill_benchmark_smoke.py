"""A smoke run of the prefill benchmark on a tiny model, so the script that measures time to the first response
per attention backend cannot rot between runs: every request answers in the first step, the attention floor counts
the pairs the mask lets through, a backend the machine cannot run gets a row that says why, and each backend that
runs is served through a real tritonserver too, its first streamed responses timed against the in-process ones."""
import sys

import pytest
import torch
from benchmark_smoke import REPO, csv_rows, run_smoke


def test_smoke_run_reports_each_backend_or_why_it_cannot_run(tmp_path):
    run_smoke("prefill.py", tmp_path, "--batches", "1,2", "--backends", "torch,flash_attn", "--served")
    rows = csv_rows(tmp_path / "prefill.csv")
    served = [r for r in rows if r["mode"] == "served"]
    rows = [r for r in rows if r["mode"] == "in process"]
    assert [(r["batch"], r["backend"]) for r in rows] == [(b, k) for b in ("1", "2") for k in ("torch", "flash_attn")]
    ran = [r for r in rows if r["backend"] == "torch"]
    # Served: only the backend that ran in process, at each batch, against its in-process figure.
    assert [(r["batch"], r["backend"]) for r in served] == [("1", "torch"), ("2", "torch")]
    for row, in_process in zip(served, ran):
        assert float(row["served_vs_in_process"]) == pytest.approx(
            float(row["ttft_ms"]) / float(in_process["ttft_ms"]), rel=2e-3)
        assert "HTTP generate_stream" in row["note"]
    for row in ran:
        assert float(row["ttft_ms"]) > 0 and float(row["ttft_vs_first_backend"]) == 1
        assert float(row["ttft_vs_floor"]) == pytest.approx(float(row["ttft_ms"]) / float(row["compute_floor_ms"]),
                                                            rel=2e-3)
    # The smoke model's multi_bd prompt is causal: 64 x 65 / 2 pairs, then its 32-token block sees all 96 keys.
    pairs = 64 * 65 // 2 + 32 * 96
    assert float(ran[1]["attention_floor_ms"]) == pytest.approx(2 * float(ran[0]["attention_floor_ms"]), rel=2e-3)
    attention_share = float(ran[0]["attention_floor_ms"]) / float(ran[0]["compute_floor_ms"])
    per_pair = 4 * 2 * 4 * 16  # 2 layers, 4 heads of 16
    layers, head = smoke_params()
    flops = per_pair * pairs + 2 * layers * 96 + 2 * head * 32  # the output head for the block's rows only
    assert attention_share == pytest.approx(per_pair * pairs / flops, rel=2e-3)
    if not torch.cuda.is_available():
        assert {r["note"] for r in rows if r["backend"] == "flash_attn"} == {
            "config field 'attention_backend' is 'flash_attn', which needs a CUDA device; use 'torch' on CPU"}
    assert (tmp_path / "prefill.md").read_text().startswith("`python benchmarks/prefill.py --smoke")


def smoke_params() -> tuple[int, int]:
    """The smoke model's parameters in its layers, and in its output head (untied, as the embedding's size)."""
    from diffulex_backend.testing.checkpoint import random_model

    sys.path.insert(0, str(REPO / "benchmarks"))
    from forward import SMOKE_SHAPE

    model = random_model(**SMOKE_SHAPE)
    head = model.lm_head.weight.numel()
    assert model.embed_tokens.weight.numel() == head
    return sum(p.numel() for p in model.parameters()) - 2 * head, head
