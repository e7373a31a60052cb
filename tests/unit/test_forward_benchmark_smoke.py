"""A smoke run of the forward benchmark: every section end to end on a tiny dense and a tiny MoE model on the CPU,
so the script cannot rot between GPU runs, and the ratios a reader takes from its table are there, finite, and
what their names say; and the MoE floors, which count only the experts a forward reaches."""
import importlib.util
import math
import pathlib
import re
import sys

import pytest
import torch
from benchmark_smoke import csv_rows, run_smoke

REPO = pathlib.Path(__file__).resolve().parents[2]


def import_forward_benchmark():
    """benchmarks/forward.py as a module (it is a script, beside the modules it imports)."""
    if "forward_benchmark" in sys.modules:
        return sys.modules["forward_benchmark"]
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("forward_benchmark", REPO / "benchmarks" / "forward.py")
        module = sys.modules["forward_benchmark"] = importlib.util.module_from_spec(spec)  # for its dataclasses
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("forward_benchmark", None)
        raise
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def ratio(row: dict, numerator: str, denominator: str) -> float:
    """The row's `numerator_vs_...` column, checked against the two columns it divides."""
    value = float(row[f"{numerator.removesuffix('_ms')}_vs_{denominator.removesuffix('_ms')}"])
    assert math.isfinite(value) and value > 0
    # Each column is written to 4 significant digits.
    assert value == pytest.approx(float(row[numerator]) / float(row[denominator]), rel=2e-3)
    return value


def test_smoke_run_reports_every_section_with_its_ratios(tmp_path):
    # On the CPU on every machine, as CI runs it: the check section's exact agreement below holds for the float32
    # torch path only.
    run_smoke("forward.py", tmp_path, cpu=True)
    rows = csv_rows(tmp_path / "forward.csv")
    by_section = {}
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
    assert sorted((r["model"], r["case"]) for r in by_section["forward"]) == [
        ("smoke", "b1_ctx64"), ("smoke", "b2_ctx64"), ("smoke-moe", "b1_ctx64"), ("smoke-moe", "b2_ctx64")]
    for row in by_section["forward"]:
        for key in ("engine_ms", "engine_step_ms", "weight_floor_ms", "compute_floor_ms"):
            assert float(row[key]) > 0
        # What the step adds to its forward, as its own column (4 significant digits each).
        assert float(row["step_outside_forward_ms"]) == pytest.approx(
            float(row["engine_step_ms"]) - float(row["engine_ms"]), abs=2e-3 * float(row["engine_step_ms"]))
        # A floor is a lower bound: no measured forward beats it, on the CPU as on the GPU.
        assert ratio(row, "engine_ms", "weight_floor_ms") > 1
        assert ratio(row, "engine_ms", "compute_floor_ms") > 1
        if row["model"] == "smoke":
            ratio(row, "engine_ms", "plain_ms")
            assert row["experts_touched"] == ""
        else:  # plain_pytorch.py has no MoE block: no plain figure, and the row says why
            assert row["plain_ms"] == row["plain_graph_ms"] == row["engine_vs_plain"] == ""
            assert "plain PyTorch not run" in row["note"]
    fwd = import_forward_benchmark()
    from diffulex_backend.registry import AutoModelForDiffusionLM
    from diffulex_backend.testing.checkpoint import random_config
    shape = dict(fwd.SMOKE_MOE_SHAPE)
    family = AutoModelForDiffusionLM.get(shape["model_name"])
    arch = family.parse_config(random_config(**shape), "smoke-moe")
    moe_rows = [r for rows_ in by_section.values() for r in rows_ if r["model"] == "smoke-moe" and r["experts_touched"]]
    assert {r["section"] for r in moe_rows} == {"forward", "decode_fixed_k", "profile"}
    for row in moe_rows:
        # Measured on the forward's own routing: some experts of each MoE layer, not all of them; and the weight
        # floor counts those, against the one uniform routing would give.
        touched, uniform = float(row["experts_touched"]), float(row["experts_touched_uniform"])
        # A mean over layers of distinct experts among tokens x K choices of K distinct experts each.
        assert arch.num_experts_per_tok <= touched <= min(arch.num_experts,
                                                           int(row["tokens"]) * arch.num_experts_per_tok)
        assert touched != uniform  # the measured count, not the uniform-routing estimate, went into the floor
        assert uniform == pytest.approx(arch.expected_touched_experts(int(row["tokens"])), rel=1e-3)
        non_expert = arch.num_params() - arch.num_moe_layers * arch.num_experts * arch.expert_params
        expected = (non_expert + arch.num_moe_layers * touched * arch.expert_params) / (
            non_expert + arch.num_moe_layers * uniform * arch.expert_params)
        floor_ratio = float(row["weight_floor_ms"]) / float(row["weight_floor_uniform_ms"])
        assert floor_ratio == pytest.approx(expected, rel=2e-3)
    assert [(r["model"], r["k"]) for r in by_section["decode_fixed_k"]] == [
        ("smoke", "1"), ("smoke", "4"), ("smoke-moe", "1"), ("smoke-moe", "4")]
    # Exactly k tokens per request per step: tokens/s over the step time gives k * batch back.
    for row in by_section["decode_fixed_k"]:
        per_step = float(row["engine_tokens_per_s"]) * float(row["engine_step_ms"]) * 1e-3
        assert abs(per_step - int(row["k"]) * int(row["batch"])) < 0.05 * per_step
        # The step against the floors of the forward it runs (the engine_vs_* columns, for a step).
        for floor in ("weight_floor", "compute_floor"):
            assert float(row[f"engine_vs_{floor}"]) == pytest.approx(
                float(row["engine_step_ms"]) / float(row[f"{floor}_ms"]), rel=2e-3)
    assert sorted(r["case"] for r in by_section["diffulex"] if r["model"] == "smoke") == [
        "d2f_buffer4_b1", "d2f_buffer4_b2", "dmax_buffer1_b1", "dmax_buffer1_b2", "fast_dllm_v2_buffer1_b1",
        "fast_dllm_v2_buffer1_b2", "multi_bd_buffer1_b1", "multi_bd_buffer1_b2"]
    # Diffulex's settings, the engine's figures only: no column compares with a figure this run did not measure.
    assert all(float(r["engine_step_ms"]) > 0 and int(r["tokens"]) > 0 for r in by_section["diffulex"])
    assert not [column for column in rows[0] if "reference" in column or "diffulex" in column]
    # On the CPU every path of the check is the float32 torch path, so they must agree exactly.
    for row in by_section["check"]:
        assert row["note"].count("greedy output equal to the float32 path for 2/2 requests") == 2
    assert "matmul" in by_section["profile"][0]["note"]
    assert (tmp_path / "forward.md").read_text().count("### ") == 5


def test_moe_floors_count_the_touched_experts_and_the_active_params():
    fwd = import_forward_benchmark()
    from diffulex_backend.testing.checkpoint import random_model

    model = random_model(**fwd.SMOKE_MOE_SHAPE, dtype=torch.float32, seed=0)
    arch, ceilings = model.arch, fwd.Ceilings(bandwidth=1e12, matmul_rate=1e14)
    bytes_per_param = 4
    # Every expert touched: the whole model streams, as for a dense one.
    every = fwd.floors(model, ceilings, batch=1, context=64, tokens=32, experts_touched=arch.num_experts)
    assert every["weight_floor_ms"] == pytest.approx(1e3 * arch.num_params() * bytes_per_param / 1e12)
    # Eight per MoE layer: the rest of the experts leave the floor.
    eight = fwd.floors(model, ceilings, batch=1, context=64, tokens=32, experts_touched=8)
    streamed = arch.num_params() - arch.num_moe_layers * (arch.num_experts - 8) * arch.expert_params
    assert eight["weight_floor_ms"] == pytest.approx(1e3 * streamed * bytes_per_param / 1e12)
    assert eight["weight_floor_ms"] < every["weight_floor_ms"]
    # Compute: the active params (K routed experts and the shared one per token), not all of them.
    assert arch.num_active_params() < arch.num_params()
    assert eight["compute_floor_ms"] == pytest.approx(1e3 * 2 * arch.num_active_params() * 32 / 1e14)
    assert every["compute_floor_ms"] == eight["compute_floor_ms"]
    # Unmeasured: the count uniform routing would reach.
    uniform = fwd.floors(model, ceilings, batch=1, context=64, tokens=32)
    assert uniform["weight_floor_ms"] == pytest.approx(fwd.floors(
        model, ceilings, 1, 64, 32, experts_touched=arch.expected_touched_experts(32))["weight_floor_ms"])
    assert uniform["weight_floor_ms"] == pytest.approx(uniform["weight_floor_uniform_ms"])


def test_routing_recorder_sees_every_moe_layer_and_restores_the_router():
    fwd = import_forward_benchmark()
    from diffulex_backend.layers import moe as moe_layer
    from diffulex_backend.testing.checkpoint import random_model

    model = random_model(**fwd.SMOKE_MOE_SHAPE, dtype=torch.float32, seed=0)
    original = moe_layer.select_experts
    x = torch.randn(5, model.arch.hidden_size)
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, moe_layer.MoE)]
    with torch.no_grad(), fwd.RecordRouting() as record:
        for mlp in moes:
            mlp(x)
    assert moe_layer.select_experts is original
    assert len(record.routes) == len(moes) == model.arch.num_moe_layers
    for ids, weights in record.routes:
        assert ids.shape == weights.shape == (5, model.arch.num_experts_per_tok)
    assert fwd.touched_per_layer(record.routes, model.arch.num_experts) == pytest.approx(
        sum(len(set(ids.flatten().tolist())) for ids, _ in record.routes) / len(moes))
    # A shared expert run among the routed ones is one more choice per token, which the count leaves out.
    with torch.no_grad(), fwd.RecordRouting() as shared:
        for mlp in moes:
            mlp.route(mlp.gate(x), num_shared=1)
    assert all((ids[:, -1] == model.arch.num_experts).all() for ids, _ in shared.routes)
    assert fwd.touched_per_layer(shared.routes, model.arch.num_experts) == fwd.touched_per_layer(
        record.routes, model.arch.num_experts)


def test_the_memory_floor_counts_the_cache_as_it_is_held():
    """With --kv-cache-dtype fp8 the cached K/V the attention reads count at head_dim + 4 bytes a row."""
    fwd = import_forward_benchmark()
    from diffulex_backend.testing.checkpoint import random_model

    model = random_model(**fwd.SMOKE_SHAPE, dtype=torch.bfloat16, seed=0)
    arch, ceilings = model.arch, fwd.Ceilings(bandwidth=1e12, matmul_rate=1e14)
    auto, fp8 = (fwd.floors(model, ceilings, batch=2, context=64, tokens=64, kv_cache_dtype=kind)
                 for kind in ("auto", "fp8"))
    rows = 2 * 64 * arch.num_layers * 2 * arch.num_kv_heads  # (token, layer, K or V, head) rows read
    assert auto["memory_floor_ms"] - auto["weight_floor_ms"] == pytest.approx(1e3 * rows * arch.head_dim * 2 / 1e12)
    assert fp8["memory_floor_ms"] - fp8["weight_floor_ms"] == pytest.approx(1e3 * rows * (arch.head_dim + 4) / 1e12)


def test_a_run_over_fp8_rows_fills_and_reads_them(tmp_path):
    run_smoke("forward.py", tmp_path, "--sections", "forward", "--kv-cache-dtype", "fp8", cpu=True)
    rows = [r for r in csv_rows(tmp_path / "forward.csv") if r["section"] == "forward"]
    assert len(rows) == 4
    for row in rows:
        assert ratio(row, "engine_ms", "weight_floor_ms") > 1


def test_fp8_floors_count_the_weights_as_held_and_the_fp8_rate():
    """An FP8 model's weight floor counts one byte a projection weight and four a scale, the rest at the model's
    dtype; its compute floor divides by the fp8 rate."""
    fwd = import_forward_benchmark()
    from diffulex_backend.quantization import fp8_params
    from diffulex_backend.testing.checkpoint import random_model

    model = random_model(**fwd.SMOKE_SHAPE, dtype=torch.bfloat16, seed=0)
    arch = model.arch
    ceilings = fwd.Ceilings(bandwidth=1e12, matmul_rate=1e14, fp8_matmul_rate=2e14)
    float_floors = fwd.floors(model, ceilings, batch=1, context=64, tokens=32)
    assert float_floors["weight_floor_ms"] == pytest.approx(1e3 * arch.num_params() * 2 / 1e12)
    projections = dict(model.named_parameters())
    quantized = {name: projections[name] for name in fp8_params(model, lm_head=False)}
    assert quantized and all(p.dim() == 2 for p in quantized.values())
    fwd.quantized(model, "fp8")
    fp8_floors = fwd.floors(model, ceilings, batch=1, context=64, tokens=32)
    weights = sum(p.numel() for p in quantized.values())
    scales = sum(p.shape[0] for p in quantized.values())  # one float32 scale an output channel
    held = (arch.num_params() - weights) * 2 + weights * 1 + scales * 4
    assert fp8_floors["weight_floor_ms"] == pytest.approx(1e3 * held / 1e12)
    assert fp8_floors["compute_floor_ms"] == pytest.approx(float_floors["compute_floor_ms"] / 2)


def test_a_run_over_fp8_weights_follows_the_float_run_of_the_same_model(tmp_path):
    run_smoke("forward.py", tmp_path, "--sections", "forward,check,profile", "--quantization", "none,fp8",
              "--batches", "1", cpu=True)
    rows = csv_rows(tmp_path / "forward.csv")
    forward = {(r["model"], r["case"]): r for r in rows if r["section"] == "forward"}
    assert sorted(forward) == [(m, "b1_ctx64") for m in ("smoke", "smoke-fp8", "smoke-moe", "smoke-moe-fp8")]
    for model in ("smoke", "smoke-moe"):
        float_row, fp8_row = forward[(model, "b1_ctx64")], forward[(f"{model}-fp8", "b1_ctx64")]
        assert ratio(fp8_row, "engine_ms", "weight_floor_ms") > 1
        # float32 weights on the CPU: the fp8 projections hold a quarter of their bytes (the exact count is
        # test_fp8_floors_count_the_weights_as_held_and_the_fp8_rate's).
        assert float(fp8_row["weight_floor_ms"]) < float(float_row["weight_floor_ms"])
        assert "fp8" in fp8_row["note"]  # plain PyTorch reads float weights: not run, and the row says so
    # The profile runs over fp8 weights too: the products alone through the fp8 projections' own path.
    profiles = {r["model"]: r["note"] for r in rows if r["section"] == "profile"}
    assert sorted(profiles) == ["smoke", "smoke-fp8", "smoke-moe", "smoke-moe-fp8"]
    assert all("matmuls alone" in note for note in profiles.values())
    # The forward without the host's work before it: on a CPU there is no graph to replay alone.
    assert all(re.search(r"with the batch built beforehand, its copy and forward [0-9.]+ ms \(no graph\)", note)
               for note in profiles.values())
    # The whole step's wall time, which a CPU has no device events to set beside.
    assert all(re.search(r"the step [0-9.]+ ms \(no device to trace\)", note) for note in profiles.values())
    # And the host's own part of it, each piece timed.
    assert all(re.search(r"building the batch [0-9.]+ ms, its logit rows [0-9.]+ ms, the forward's launch [0-9.]+ ms",
                         note) for note in profiles.values())
    # Each kind's launches, and the forward's: a MoE layer launches more kernels than a dense one.
    launches = {model: int(re.search(r" in (\d+) launches(;|$)", note).group(1)) for model, note in profiles.items()}
    assert all(re.search(r"matmul [0-9.]+ \(\d+\)", note) for note in profiles.values())
    assert 0 < launches["smoke"] < launches["smoke-moe"]
    checks = {(r["model"], r["case"]): r for r in rows if r["section"] == "check"}
    # The float32 reference copy is a float model's check only; the fp8 model gets its logits against the float's:
    # each layer fed the float forward's input, the output so fed, and the whole forward.
    fp8_cases = ["fp8_output_layers_fed", "fp8_vs_float_weights"]
    assert sorted(checks) == sorted(
        [("smoke", "kernels+graphs vs torch path"), ("smoke-moe", "kernels+graphs vs torch path")]
        + [("smoke-fp8", c) for c in fp8_cases + ["fp8_layer_0", "fp8_layer_1"]]
        + [("smoke-moe-fp8", c) for c in fp8_cases + ["fp8_layer_0", "fp8_layer_1", "fp8_layer_2"]])
    fwd = import_forward_benchmark()
    for (model, case), row in checks.items():
        if not model.endswith("-fp8"):
            continue
        assert 0 < float(row["error"]) < 1  # quantized, so not equal; the same weights, so near
        # A bound is stated for a dense layer fed the float input and for the output after a dense last layer, and
        # holds here; a MoE layer's, whose tokens may change experts, and the compounded forward's are not.
        bounded = {"fp8_output_layers_fed": model == "smoke-fp8", "fp8_vs_float_weights": False,
                   "fp8_layer_1": model == "smoke-fp8", "fp8_layer_2": False}.get(case, True)
        if bounded:
            bound = fwd.FP8_OUTPUT_BOUND if case == "fp8_output_layers_fed" else fwd.FP8_LAYER_BOUND
            assert float(row["bound"]) == bound and row["within"] == "True"
            assert float(row["error"]) <= bound
        else:
            assert row["bound"] == row["within"] == ""


def test_a_layer_fed_the_inputs_of_its_own_forward_gives_that_forward_s_outputs_and_logits(tmp_path):
    """The layer tap's feed replaces each layer's input and nothing else: fed its own forward's inputs, a model
    gives the same outputs bit for bit, and fed another input, only the layer so fed differs."""
    fwd = import_forward_benchmark()
    device = torch.device("cpu")
    model, model_dir = fwd.build_model(fwd.SMOKE_SHAPE, tmp_path, torch.float32, device, smoke=True)
    first = fwd.check_forward(model, model_dir, device, fwd.SMOKE)
    assert len(first.layer_inputs) == len(first.layer_outputs) == fwd.SMOKE_SHAPE["num_layers"]
    again = fwd.check_forward(model, model_dir, device, fwd.SMOKE, feed=first.layer_inputs)
    assert torch.equal(again.module_logits, first.module_logits)
    for ours, theirs in zip(again.layer_outputs, first.layer_outputs):
        assert torch.equal(ours, theirs)
    # Fed the second layer's input as the first's, the first layer's output moves; the second layer, fed its own,
    # gives its own output: each layer's difference is its own.
    assert fwd.SMOKE_SHAPE["num_layers"] == 2
    moved = fwd.check_forward(model, model_dir, device, fwd.SMOKE, feed=[first.layer_inputs[1], first.layer_inputs[1]])
    assert not torch.equal(moved.layer_outputs[0], first.layer_outputs[0])
    assert torch.equal(moved.layer_outputs[1], first.layer_outputs[1])
    assert torch.equal(moved.module_logits, first.module_logits)  # the last layer's output, so fed, is the output


def test_quantization_order_and_names_are_checked(tmp_path):
    fwd = import_forward_benchmark()
    for bad in ("fp8,none", "int4", "none,none"):
        with pytest.raises(SystemExit):
            fwd.main(["--smoke", "--out", str(tmp_path), "--quantization", bad])


def test_diffusion_gemma_floors_count_its_parameters_and_its_experts():
    """The canvas model's weight floor streams every parameter it holds (its stacked experts counted as experts, so
    that fewer touched experts stream fewer bytes), and its compute floor multiplies by the active ones."""
    fwd = import_forward_benchmark()
    from diffulex_backend.testing.diffusion_gemma_checkpoint import random_diffusion_gemma, tiny_config

    model = random_diffusion_gemma(tiny_config(), "smoke-gemma", dtype=torch.float32)
    arch, ceilings = model.arch, fwd.Ceilings(bandwidth=1e12, matmul_rate=1e14)
    assert sum(p.numel() for p in model.parameters()) == arch.num_params()
    held, experts = fwd.held_bytes(model)
    assert held == 4 * arch.num_params()
    assert experts == 4 * arch.num_moe_layers * arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size
    every = fwd.floors(model, ceilings, batch=1, context=16, tokens=8, experts_touched=arch.num_experts)
    assert every["weight_floor_ms"] == pytest.approx(1e3 * held / 1e12)
    one = fwd.floors(model, ceilings, batch=1, context=16, tokens=8, experts_touched=1)
    assert one["weight_floor_ms"] == pytest.approx(1e3 * (held - experts * (1 - 1 / arch.num_experts)) / 1e12)
    assert every["compute_floor_ms"] == pytest.approx(1e3 * 2 * arch.num_active_params() * 8 / 1e14)


def test_a_canvas_run_times_diffusion_gemma_s_steps_and_nothing_else(tmp_path):
    run_smoke("forward.py", tmp_path, "--models", "smoke-gemma", "--sections", "forward,canvas,canvas_profile",
              cpu=True)
    rows = csv_rows(tmp_path / "forward.csv")
    canvas = [r for r in rows if r["section"] == "canvas"]
    # The masked-block sections do not apply to a canvas model: only its canvas rows, one per batch, and the
    # profile of its first batch's steps.
    assert [r["section"] for r in rows if r["section"] != "ceiling"] == ["canvas", "canvas", "canvas_profile"]
    profile = rows[-1]
    assert (profile["case"], float(profile["engine_step_ms"]) > 0) == ("b1", True)
    assert "ms a step by kernel kind: " in profile["note"] and "step wall time less the sum" in profile["note"]
    from diffulex_backend.testing.diffusion_gemma_checkpoint import TINY, TINY_SCHEDULE
    for row, batch in zip(canvas, (1, 2)):
        assert (row["case"], int(row["batch"]), int(row["tokens"])) == (
            f"b{batch}", batch, batch * TINY["canvas_length"])
        for floor in ("weight_floor", "compute_floor"):  # the step against the floors of the rows it feeds
            assert float(row[f"engine_vs_{floor}"]) == pytest.approx(
                float(row["engine_step_ms"]) / float(row[f"{floor}_ms"]), rel=2e-3)
            assert float(row[f"engine_vs_{floor}"]) > 1
        # Two canvases a request, each at most the schedule's steps, and the prompt's step.
        steps = int(row["note"].split(" steps,")[0])
        assert 2 < steps <= 2 * TINY_SCHEDULE.max_denoising_steps + 1
    assert float(canvas[1]["compute_floor_ms"]) == pytest.approx(2 * float(canvas[0]["compute_floor_ms"]), rel=2e-3)


def test_a_step_s_device_time_is_the_union_of_its_events_and_its_gaps_lie_between_them():
    forward = import_forward_benchmark()
    # Two dependent launches that overlap, a gap of 10, then two kernels 1 apart.
    events = [(0.0, 10.0, "a"), (5.0, 20.0, "b"), (30.0, 40.0, "c"), (41.0, 50.0, "d")]
    busy, span, gaps = forward.busy_and_gaps(events)
    assert (busy, span) == (39.0, 50.0)  # not the sum, 44
    assert gaps == [(10.0, 20.0, 30.0, "c"), (1.0, 40.0, 41.0, "d")]
    # A kernel inside an earlier one's time leaves no gap and adds nothing.
    assert forward.busy_and_gaps([(0.0, 10.0, "a"), (2.0, 3.0, "b"), (12.0, 13.0, "c")]) == (
        11.0, 13.0, [(2.0, 10.0, 12.0, "c")])
