"""LoRA adapters in PEFT's layout: merged at load and applied per request give the same tokens, a mixed batch
equals each request run alone, the prefix cache never crosses adapters, every bad adapter or request is refused with
the file and key at fault, and a request whose adapter overflows at run time fails alone."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex_backend import Diffulex, FinishReason, SamplingParams
from diffulex_backend.cuda_graph import PaddedForward
from diffulex_backend.layers.lora import LoraBatch, LoraSegments, LoraStack, add_lora, segment_table
from diffulex_backend.loader import load_model
from diffulex_backend.lora import LoraError, lora_batch, load_adapter
from diffulex_backend.plan import RequestSampling, SeqPlan
from diffulex_backend.sampling import Confidence
from diffulex_backend.serving.engine_settings import engine_settings
from diffulex_backend.testing.checkpoint import write_peft_adapter, write_random_checkpoint
from engine_driver import Stream, run_requests, step_checked, tiny_engine
from families import write_overflowing_adapter

# Every attention and MLP projection, under each family's own module names.
TARGETS = {
    "llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"],
    "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "sdar": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
SYSTEM = "a shared system prompt that spans twelve pages: "  # 48 tokens: 12 full pages of 4


def with_lora(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True, lora_name=name)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per family: "full" (rank 4, every projection), "attn" (rank 2, q/k/v only, rsLoRA)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for family, path in tiny_checkpoints.items():
        out[family] = {
            "full": str(write_peft_adapter(root / family / "full", path, TARGETS[family], rank=4, seed=1)),
            "attn": str(write_peft_adapter(root / family / "attn", path, TARGETS[family][:3], rank=2, seed=2,
                                           use_rslora=True, lora_alpha=4.0)),
        }
    return out


def lora_engine(path: str, adapters: dict[str, str], **overrides):
    return tiny_engine(path, lora_modules=f"full={adapters['full']},attn={adapters['attn']}", **overrides)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_merged_and_unmerged_adapters_give_the_same_tokens(tiny_checkpoints, adapters, family):
    path, prompt = tiny_checkpoints[family], "merge me, then apply me"
    base = run_requests(tiny_engine(path), [prompt], PARAMS)[0].token_ids
    for name in ("full", "attn"):
        merged = tiny_engine(path, lora_path=adapters[family][name], pre_merge_lora=True)
        unmerged = lora_engine(path, adapters[family])
        want = run_requests(merged, [prompt], PARAMS)[0].token_ids
        assert run_requests(unmerged, [prompt], with_lora(name))[0].token_ids == want
        assert want != base  # the adapter is not a no-op, so the comparison says something


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mixed_batch_with_two_adapters_and_none_equals_each_request_alone(tiny_checkpoints, adapters, family):
    path = tiny_checkpoints[family]
    prompts = ["first prompt, full", "second one: attn only", "third, the base model", "fourth, full again"]
    params = [with_lora("full"), with_lora("attn"), with_lora(None), with_lora("full")]
    alone = [run_requests(lora_engine(path, adapters[family], enable_prefix_caching=False), [prompt], p)[0].token_ids
             for prompt, p in zip(prompts, params)]
    together = run_requests(lora_engine(path, adapters[family]), prompts, params)
    assert [s.token_ids for s in together] == alone
    # A request without an adapter runs the base model, whatever else shares its batch.
    assert alone[2] == run_requests(tiny_engine(path), [prompts[2]], PARAMS)[0].token_ids


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prefix_cache_never_serves_one_adapters_pages_to_another(tiny_checkpoints, adapters, family):
    path, prompt = tiny_checkpoints[family], SYSTEM + "one, and more"  # 61 tokens: 15 reusable pages
    want = {name: run_requests(lora_engine(path, adapters[family], enable_prefix_caching=False), [prompt],
                               with_lora(name))[0].token_ids for name in ("full", "attn", None)}
    llm = lora_engine(path, adapters[family])
    hits = []
    for name in ("full", "attn", None, "attn", "full"):
        assert run_requests(llm, [prompt], with_lora(name))[0].token_ids == want[name]
        hits.append(llm.metrics().prefix_cache_hit_tokens)
    # The first run under each adapter (and without one) finds nothing; a second run under the same one hits.
    assert hits[:3] == [0, 0, 0]
    assert hits[3] - hits[2] == 60 and hits[4] - hits[3] == 60


def test_rows_without_an_adapter_pay_nothing_and_keep_their_values():
    x = torch.randn(6, 8, dtype=torch.float64)
    stack = LoraStack(a=torch.randn(2, 3, 8, dtype=torch.float64), b=torch.randn(2, 5, 3, dtype=torch.float64))
    out = torch.zeros(6, 5, dtype=torch.float64)
    add_lora(out, x, stack, LoraBatch(((1, 0, 2), (0, 4, 6))))
    assert torch.equal(out[2:4], torch.zeros(2, 5, dtype=torch.float64))
    torch.testing.assert_close(out[:2], x[:2] @ stack.a[1].T @ stack.b[1].T)
    torch.testing.assert_close(out[4:], x[4:] @ stack.a[0].T @ stack.b[0].T)


def plan_under(slot: int, num_tokens: int) -> SeqPlan:
    sampling = RequestSampling(seed=0, temperature=0.0, top_k=0, top_p=1.0, confidence_kind=Confidence.PROB,
                               accept_threshold=0.9, remask_threshold=0.0, lora_index=slot)
    empty = np.zeros(num_tokens, dtype=np.int64)
    return SeqPlan("r", 0, num_tokens, 0, empty, empty, empty.astype(np.int32), [], [], 0, 0, sampling)


def test_each_sequence_with_an_adapter_is_a_segment_of_its_own():
    # Two sequences under one adapter back to back stay two segments: no segment is longer than one sequence's
    # feed, which is what sizes a CUDA graph's LoRA kernels.
    plans = [plan_under(1, 4), plan_under(1, 3), plan_under(-1, 5), plan_under(0, 2), plan_under(0, 0)]
    assert lora_batch(plans) == LoraBatch(((1, 0, 4), (1, 4, 7), (0, 12, 14)))
    assert lora_batch([plan_under(-1, 4), plan_under(-1, 2)]) is None


def test_segment_table_pads_with_empty_segments_that_add_nothing():
    batch = LoraBatch(((1, 0, 4), (0, 6, 9)))
    table = segment_table(batch, 4)
    assert table.tolist() == [[1, 0, 4], [0, 6, 9], [0, 0, 0], [0, 0, 0]]
    x = torch.randn(10, 8, dtype=torch.float64)
    stack = LoraStack(a=torch.randn(2, 3, 8, dtype=torch.float64), b=torch.randn(2, 5, 3, dtype=torch.float64))
    from_table = add_lora(torch.zeros(10, 5, dtype=torch.float64), x, stack, LoraSegments(table, max_rows=8))
    assert torch.equal(from_table, add_lora(torch.zeros(10, 5, dtype=torch.float64), x, stack, batch))
    with pytest.raises(ValueError, match="2 LoRA segments do not fit a table of 1"):
        segment_table(batch, 1)


class CountingPaddedForward(PaddedForward):
    """The padded forward (what the CUDA graphs replay), counting its steps with and without adapter rows."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = {True: 0, False: 0}

    def run(self, bucket, batch, lora=None, *changed):
        self.steps[lora is not None] += 1
        return super().run(bucket, batch, lora, *changed)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mixed_batch_through_the_padded_lora_forward_gives_the_eager_tokens(tiny_checkpoints, adapters, family):
    path = tiny_checkpoints[family]
    prompts = ["first prompt, full", "second one: attn only", "third, the base model", "fourth, full again"]
    params = [with_lora("full"), with_lora("attn"), with_lora(None), with_lora("full")]
    eager = run_requests(lora_engine(path, adapters[family], buffer_size=2), prompts, params)
    llm = lora_engine(path, adapters[family], buffer_size=2)
    padded = llm.runner.padded_forward = CountingPaddedForward(llm.model, llm.runner.kv_cache, llm.config, llm.device)
    assert [s.token_ids for s in run_requests(llm, prompts, params)] == [s.token_ids for s in eager]
    assert padded.steps[True] > 5, "decode steps with adapter rows should have gone through the padded forward"
    # Without adapter rows, the padded forward without the delta, which gives the engine's tokens without adapters.
    plain = [with_lora(None)] * 2
    assert [s.token_ids for s in run_requests(llm, prompts[:2], plain)] == \
        [s.token_ids for s in run_requests(tiny_engine(path, buffer_size=2), prompts[:2], plain)]
    assert padded.steps[False] > 5


def test_config_pbtxt_parameters_register_adapters(llada_checkpoint, adapters):
    parameters = {"model": llada_checkpoint,
                  "lora_modules": f"full={adapters['llada']['full']}, attn={adapters['llada']['attn']}",
                  "max_loras": "2", "max_lora_rank": "4", "block_size": "4", "page_size": "4",
                  "max_model_len": "96", "max_num_batched_tokens": "128", "dtype": "float64", "device": "cpu"}
    settings = engine_settings({k: {"string_value": v} for k, v in parameters.items()}, "/")
    llm = Diffulex(**settings)
    assert sorted(llm.lora_slots) == ["attn", "full"]
    assert run_requests(llm, ["x"], with_lora("attn"))[0].finish_reason is not None


# ---- refusals --------------------------------------------------------------------------------------------------

def test_unknown_lora_name_is_refused_naming_the_registered_ones(llada_checkpoint, adapters):
    llm = lora_engine(llada_checkpoint, adapters["llada"])
    with pytest.raises(ValueError, match=r"'lora_name' is 'nope'.*\['attn', 'full'\]"):
        llm.prepare_request("hi", with_lora("nope"))
    with pytest.raises(ValueError, match=r"'lora_name' is 'full'.*\[\]"):
        tiny_engine(llada_checkpoint).prepare_request("hi", with_lora("full"))
    with pytest.raises(ValueError, match="'lora_name' must be a non-empty string"):
        with_lora("")


@pytest.mark.parametrize("overrides, message", [
    (dict(lora_path="/x"), "'lora_path' and 'pre_merge_lora' go together"),
    (dict(pre_merge_lora=True), "'lora_path' and 'pre_merge_lora' go together"),
    (dict(lora_modules="a=/x,b=/y", max_loras=1), "registers 2 adapters, more than 'max_loras' \\(1\\)"),
    (dict(lora_modules="a=/x,a=/y"), "names adapter 'a' twice"),
    (dict(lora_modules="a"), "name=path pairs"),
    (dict(lora_modules={"a,b": "/x"}), "names an adapter 'a,b': a name is a non-empty string without"),
    (dict(lora_modules={"a": "/x,/y"}), "gives adapter 'a' the path '/x,/y'"),
    (dict(lora_modules={"a": None}), "gives adapter 'a' the path None"),
    (dict(max_lora_rank=0), "'max_lora_rank' must be an integer >= 1"),
])
def test_bad_lora_config_is_refused(llada_checkpoint, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine(llada_checkpoint, **overrides)


def test_lora_modules_take_a_dict_in_python_and_name_the_same_adapters_as_the_text(llada_checkpoint, adapters):
    paths = adapters["llada"]
    as_dict = tiny_engine(llada_checkpoint, lora_modules={"full": Path(paths["full"]), "attn": paths["attn"]})
    as_text = lora_engine(llada_checkpoint, paths)
    assert as_dict.config.lora_module_paths == as_text.config.lora_module_paths == {"full": paths["full"],
                                                                                    "attn": paths["attn"]}
    assert as_dict.lora_slots == as_text.lora_slots == {"full": 0, "attn": 1}
    params = [with_lora("full"), with_lora("attn")]
    assert [o.token_ids for o in run_requests(as_dict, ["pick one", "pick the other"], params)] == [
        o.token_ids for o in run_requests(as_text, ["pick one", "pick the other"], params)]


@pytest.fixture(scope="module")
def llada_model(llada_checkpoint):
    return load_model(llada_checkpoint, dtype=torch.float64)


def rewrite(directory, config_changes=None, tensors_change=None):
    if config_changes:
        config_path = directory / "adapter_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config_changes}))
    if tensors_change:
        weights = directory / "adapter_model.safetensors"
        tensors = load_file(weights)
        tensors_change(tensors)
        save_file(tensors, weights)
    return directory


@pytest.mark.parametrize("config_changes, message", [
    (dict(modules_to_save=["lm_head"]), "adapter_config.json: key 'modules_to_save'.*replaces whole modules"),
    (dict(r=8), "adapter_config.json: key 'r' is 8, above config field 'max_lora_rank' \\(4\\)"),
    (dict(use_dora=True), "adapter_config.json: key 'use_dora' is True"),
    (dict(peft_type="IA3"), "adapter_config.json: key 'peft_type' is 'IA3'"),
    (dict(target_modules=["q_proj"]),
     "adapter_model.safetensors: .*'model.transformer.blocks.0.attn_out', which adapter_config.json's target_modules"),
    (dict(lora_alpha="8"), "adapter_config.json: key 'lora_alpha' must be a number"),
])
def test_bad_adapter_config_is_refused_naming_file_and_key(llada_checkpoint, llada_model, tmp_path, config_changes,
                                                           message):
    directory = rewrite(write_peft_adapter(tmp_path / "a", llada_checkpoint, TARGETS["llada"]), config_changes)
    with pytest.raises(LoraError, match=message):
        load_adapter(directory, llada_model, "a", max_rank=4)


def test_adapter_rank_above_max_lora_rank_is_refused_at_engine_load(llada_checkpoint, tmp_path):
    directory = write_peft_adapter(tmp_path / "a", llada_checkpoint, ["q_proj"], rank=8)
    with pytest.raises(ValueError, match="adapter_config.json: key 'r' is 8, above config field 'max_lora_rank'"):
        tiny_engine(llada_checkpoint, lora_modules=f"a={directory}", max_lora_rank=4)


def test_adapter_whose_shapes_do_not_fit_the_model_is_refused(llada_checkpoint, llada_model, tmp_path):
    other = write_random_checkpoint(tmp_path / "wider", "llada", hidden_size=32, num_heads=2, num_kv_heads=2)
    directory = write_peft_adapter(tmp_path / "a", other, ["q_proj"])
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: .*blocks.0.q_proj.lora_A.weight has shape "
                                        r"\(4, 32\), expected \(4, 64\)"):
        load_adapter(directory, llada_model, "a", max_rank=4)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"base_model.model.model.transformer.wte.lora_A.weight": torch.zeros(4, 64),
                         "base_model.model.model.transformer.wte.lora_B.weight": torch.zeros(258, 4)}),
     "adapts 'model.transformer.wte', which is not an attention or MLP projection"),
    (lambda t: t.update({"base_model.model.model.transformer.ff_out.lora_A.weight": torch.zeros(4, 64),
                         "base_model.model.model.transformer.ff_out.lora_B.weight": torch.zeros(258, 4)}),
     "adapts 'model.transformer.ff_out', which is not an attention or MLP projection"),
    (lambda t: t.pop("base_model.model.model.transformer.blocks.1.q_proj.lora_B.weight"),
     "blocks.1.q_proj.lora_B.weight is missing"),
    (lambda t: t.update({"base_model.model.lm_head.modules_to_save.weight": torch.zeros(2)}),
     "unexpected tensor 'base_model.model.lm_head.modules_to_save.weight'"),
    (lambda t: t["base_model.model.model.transformer.blocks.1.q_proj.lora_A.weight"].__setitem__((0, 0), float("nan")),
     r"adapter 'a': tensor 'base_model.model.model.transformer.blocks.1.q_proj.lora_A.weight' holds NaN or infinite "
     r"values: 1 of its 256$"),
    (lambda t: t["base_model.model.model.transformer.blocks.0.v_proj.lora_B.weight"].fill_(float("-inf")),
     r"tensor 'base_model.model.model.transformer.blocks.0.v_proj.lora_B.weight' holds NaN or infinite values: 128 of "
     r"its 128$"),
])
def test_bad_adapter_tensors_are_refused_naming_the_key(llada_checkpoint, llada_model, tmp_path, change, message):
    directory = rewrite(write_peft_adapter(tmp_path / "a", llada_checkpoint, TARGETS["llada"]), tensors_change=change)
    with pytest.raises(LoraError, match="adapter_model.safetensors: .*" + message):
        load_adapter(directory, llada_model, "a", max_rank=4)


@pytest.mark.parametrize("setting", ["lora_modules", "lora_path"])
def test_adapter_values_past_the_model_dtype_are_refused_attached_or_merged(llada_checkpoint, tmp_path, setting):
    """Finite in the adapter's float32 file, infinite once cast to a float16 model (attached) or added into its
    weight (merged): either would decode noise, so the load fails, naming the adapter, the module and the count."""
    from diffulex_backend.config import Config
    from diffulex_backend.model_setup import load_model_with_adapters

    key = "base_model.model.model.transformer.blocks.1.q_proj.lora_A.weight"
    directory = rewrite(write_peft_adapter(tmp_path / "a", llada_checkpoint, ["q_proj"]),
                        tensors_change=lambda t: t[key][0].fill_(1e9))
    if setting == "lora_modules":
        config = Config(model=str(llada_checkpoint), lora_modules=f"a={directory}", max_lora_rank=4)
        message = (r"adapter 'a': model.transformer.blocks.1.q_proj's lora_A is past the range of float16 \(largest "
                   r"65504\), the dtype the model loads in, at 64 of its 256 values; load it in a wider one")
    else:
        config = Config(model=str(llada_checkpoint), lora_path=str(directory), pre_merge_lora=True, max_lora_rank=4)
        message = (r"adapter 'lora_path' merged into model.transformer.blocks.1.q_proj is past the range of float16 "
                   r"\(largest 65504\), the dtype the model loads in, at 4096 of its 4096 values; load it in a "
                   r"wider one")
    with pytest.raises(LoraError, match=message):
        load_model_with_adapters(config, torch.device("cpu"), torch.float16)
    # In float32 the same adapter loads.
    load_model_with_adapters(config, torch.device("cpu"), torch.float32)


def test_unreadable_adapter_files_are_refused(llada_checkpoint, llada_model, tmp_path):
    with pytest.raises(LoraError, match="directory not found"):
        load_adapter(tmp_path / "absent", llada_model, "a", max_rank=4)
    directory = write_peft_adapter(tmp_path / "a", llada_checkpoint, ["q_proj"])
    (directory / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraError, match="adapter_model.safetensors: not a readable safetensors file"):
        load_adapter(directory, llada_model, "a", max_rank=4)
    (directory / "adapter_config.json").write_text("{")
    with pytest.raises(LoraError, match="adapter_config.json: not valid JSON"):
        load_adapter(directory, llada_model, "a", max_rank=4)


NON_FINITE_ERROR = ("decoding failed: the model's logits for this request hold NaN or infinite values under adapter "
                    "'huge', so its tokens would be noise")


@pytest.fixture(scope="module")
def overflowing_engine(llada_checkpoint, tmp_path_factory) -> Diffulex:
    """A float32 engine whose adapter 'huge' loads and overflows every forward it takes part in. No prefix cache: a
    request run alone and the same request in a batch then compute the same forwards."""
    adapter = write_overflowing_adapter(tmp_path_factory.mktemp("adapters") / "huge", llada_checkpoint)
    return tiny_engine(llada_checkpoint, dtype="float32", lora_modules=f"huge={adapter}", enable_prefix_caching=False)


def test_a_request_whose_adapter_overflows_fails_alone_in_its_batch_and_frees_its_pages(overflowing_engine):
    llm = overflowing_engine
    (alone,) = run_requests(llm, ["a request without an adapter"], PARAMS)
    failing = llm.add_request("a request under the adapter", with_lora("huge"))
    healthy = llm.add_request("a request without an adapter", PARAMS)
    streams = {failing: Stream(failing), healthy: Stream(healthy)}
    forwards_of_failing = 0
    while llm.has_unfinished_requests():
        deltas = step_checked(llm)
        forwards_of_failing += failing in {plan.request_id for plan in llm.last_schedule.plans}
        for delta in deltas:
            streams[delta.request_id].deltas.append(delta)
            if delta.request_id == failing:
                assert {plan.request_id for plan in llm.last_schedule.plans} == {failing, healthy}  # one batch
                # Its pages are back in the pool at once: only the other request holds any.
                assert llm.metrics().kv_pages_used == len(llm.requests[healthy].page_table) > 0
    (error,) = streams[failing].deltas
    assert (error.token_ids, error.finished, error.finish_reason) == ([], True, FinishReason.ERROR)
    assert error.error == NON_FINITE_ERROR
    assert error.nfe == forwards_of_failing  # the forward that failed it counts
    assert streams[healthy].token_ids == alone.token_ids
    assert streams[healthy].finish_reason == alone.finish_reason == FinishReason.LENGTH
    assert llm.metrics().kv_pages_used == 0


def test_generate_returns_the_failed_requests_error_beside_the_others_outputs(overflowing_engine):
    failed, served = overflowing_engine.generate(["under the adapter", "without"], [with_lora("huge"), PARAMS])
    assert (failed.finish_reason, failed.error, failed.token_ids) == (FinishReason.ERROR, NON_FINITE_ERROR, [])
    assert (served.finish_reason, served.error, len(served.token_ids)) == (FinishReason.LENGTH, None, 12)
