"""The segmented LoRA shrink/expand kernels match the torch reference (layers/lora.add_lora) on a mixed batch,
and leave the rows of no segment untouched; the SiLU-and-mul with gate_up's expand folded in matches the reference
delta followed by the SiLU, row by row, whatever adapters a tile of rows spans."""
from __future__ import annotations

import pytest
import torch

import diffulex_kernels.lora as lora_kernels
from diffulex_backend.layers.lora import LoraBatch, LoraStack, add_lora, row_slots
from diffulex_kernels.lora import MANY_ROWS, add_lora_segments, shrink, silu_and_mul_lora
from kernel_cases import DEVICE, FULL_SHAPES, REL_TOL, generator, randn, relative_error

# (rows, in, out, rank width, adapters): LLaDA-8B's qkv at rank 16 x 3 parts, or small ragged ones.
SHAPES = [(512, 4096, 12288, 48, 4)] if FULL_SHAPES else [(40, 72, 80, 12, 3), (21, 64, 48, 16, 2)]


def segments_for(rows: int, adapters: int) -> list[tuple[int, int, int]]:
    """Adapter 1, a gap (no adapter), adapter 0 over more than one row tile, the last adapter, a gap at the end."""
    middle = 5 + rows // 3 + 2
    return [(1, 0, 3), (0, 5, middle), (adapters - 1, middle, rows - 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_segmented_delta_matches_the_reference_and_skips_rows_without_adapter(shape, dtype):
    rows, k, n, r, adapters = shape
    gen = generator(rows + k)
    x = randn(rows, k, dtype=dtype, gen=gen)
    stack = LoraStack(a=randn(adapters, r, k, dtype=dtype, gen=gen) / k ** 0.5,
                      b=randn(adapters, n, r, dtype=dtype, gen=gen) / r ** 0.5)
    base = randn(rows, n, dtype=dtype, gen=gen)
    segments = segments_for(rows, adapters)
    reference = add_lora(base.double().clone(), x.double(),
                         LoraStack(stack.a.double(), stack.b.double()), LoraBatch(tuple(segments)))
    out = add_lora_segments(base.clone(), x, stack.a, stack.b, torch.tensor(segments, device=DEVICE),
                            max_rows=max(end - start for _, start, end in segments))
    covered = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    for _, start, end in segments:
        covered[start:end] = True
    assert torch.equal(out[~covered], base[~covered])  # rows of no segment: not a bit changed
    assert relative_error(out[covered] - base[covered], reference[covered] - base[covered].double()) < REL_TOL[dtype]


def test_no_segments_leave_the_output_alone():
    gen = generator(1)
    out = randn(4, 32, dtype=torch.float32, gen=gen)
    before = out.clone()
    add_lora_segments(out, randn(4, 16, dtype=torch.float32, gen=gen), randn(1, 16, 16, dtype=torch.float32, gen=gen),
                      randn(1, 32, 16, dtype=torch.float32, gen=gen), torch.zeros(0, 3, dtype=torch.int64,
                                                                                     device=DEVICE), max_rows=0)
    assert torch.equal(out, before)


def test_an_upper_bound_on_segment_rows_gives_the_same_result():
    # A caller that keeps the launch shape fixed passes the batch's row count instead of the longest segment.
    gen = generator(2)
    x, a, b = (randn(30, 32, dtype=torch.float32, gen=gen), randn(2, 16, 32, dtype=torch.float32, gen=gen),
               randn(2, 48, 16, dtype=torch.float32, gen=gen))
    segments = torch.tensor([(1, 2, 9), (0, 9, 11)], device=DEVICE)
    base = randn(30, 48, dtype=torch.float32, gen=gen)
    tight = add_lora_segments(base.clone(), x, a, b, segments, max_rows=7)
    loose = add_lora_segments(base.clone(), x, a, b, segments, max_rows=30)
    assert torch.equal(tight, loose)


@pytest.mark.parametrize("rows", [40, MANY_ROWS + 24], ids=["few_rows", "many_rows"])  # tiles of 16 and 32 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_with_the_gate_up_delta_matches_the_reference(rows, dtype):
    # gate_up's two parts side by side along the rank, as attach_adapters stacks them. Segments start off the
    # tile grid, so one tile holds rows of adapter 2, of no adapter and of adapter 0; two requests share adapter 0.
    k, size, width, adapters = 48, 40, 8, 3
    gen = generator(rows)
    x = randn(rows, k, dtype=dtype, gen=gen)
    stack = LoraStack(a=randn(adapters, 2 * width, k, dtype=dtype, gen=gen) / k ** 0.5,
                      b=randn(adapters, 2 * size, 2 * width, dtype=dtype, gen=gen) / width ** 0.5)
    base = randn(rows, 2 * size, dtype=dtype, gen=gen)
    third = 21 + (rows - 26) // 2
    batch = LoraBatch(((2, 3, 11), (0, 14, 21), (0, 21, third), (1, third, rows - 5)))
    table = torch.tensor(batch.segments, device=DEVICE)
    bound = max(end - start for _, start, end in batch.segments)
    out = silu_and_mul_lora(base, shrink(x, stack.a, table, bound), stack.b, row_slots(table, rows))

    adapted = add_lora(base.double().clone(), x.double(), LoraStack(stack.a.double(), stack.b.double()), batch)
    gate, up = adapted.split(size, dim=-1)
    reference = torch.nn.functional.silu(gate) * up
    assert relative_error(out, reference) < REL_TOL[dtype]
    # Rows of no adapter are the plain SiLU-and-mul of the base product.
    plain = torch.cat([torch.arange(0, 3), torch.arange(11, 14), torch.arange(rows - 5, rows)]).to(DEVICE)
    gate, up = base[plain].double().split(size, dim=-1)
    assert relative_error(out[plain], torch.nn.functional.silu(gate) * up) < REL_TOL[dtype]


@pytest.mark.parametrize("sum_first", [False, True], ids=["partials_read", "partials_summed_first"])
def test_split_partial_sums_give_the_reference_whether_or_not_they_are_added_up_first(sum_first, monkeypatch):
    # K = 300 splits into shares of 128, so the readers get several partial sums; a threshold of 0 bytes makes
    # both readers (the expand and the SiLU) take the one-launch sum first.
    if sum_first:
        monkeypatch.setattr(lora_kernels, "SUM_FIRST_BYTES", 0)
    rows, k, size, width, adapters = 24, 300, 24, 8, 2
    gen = generator(9)
    x = randn(rows, k, dtype=torch.float32, gen=gen)
    stack = LoraStack(a=randn(adapters, 2 * width, k, dtype=torch.float32, gen=gen) / k ** 0.5,
                      b=randn(adapters, 2 * size, 2 * width, dtype=torch.float32, gen=gen) / width ** 0.5)
    base = randn(rows, 2 * size, dtype=torch.float32, gen=gen)
    batch = LoraBatch(((1, 2, 10), (0, 12, 22)))
    table = torch.tensor(batch.segments, device=DEVICE)
    partials = shrink(x, stack.a, table, 10)
    assert partials.shape[0] == 3
    reference = add_lora(base.double().clone(), x.double(), LoraStack(stack.a.double(), stack.b.double()), batch)
    out = add_lora_segments(base.clone(), x, stack.a, stack.b, table, 10)
    assert relative_error(out - base, reference - base.double()) < 1e-5
    gate, up = reference.split(size, dim=-1)
    h = silu_and_mul_lora(base, partials, stack.b, row_slots(table, rows))
    assert relative_error(h, torch.nn.functional.silu(gate) * up) < 1e-5


def test_mismatched_silu_inputs_are_refused():
    gen = generator(4)
    gate_up, b = randn(8, 32, dtype=torch.float32, gen=gen), randn(2, 32, 8, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match="do not fit"):
        silu_and_mul_lora(gate_up, torch.zeros(1, 8, 8, device=DEVICE), b, torch.full((7,), -1, device=DEVICE))


def test_row_slots_name_each_rows_adapter_and_none_elsewhere():
    table = torch.tensor([(2, 1, 3), (0, 3, 4), (0, 0, 0), (1, 6, 8)], device=DEVICE)  # an empty padding row
    assert row_slots(table, 9).tolist() == [-1, 2, 2, 0, -1, -1, 1, 1, -1]
    assert row_slots(torch.tensor([(1, 0, 4)], device=DEVICE), 4).tolist() == [1, 1, 1, 1]  # ends at the last row
    assert row_slots(torch.zeros(0, 3, dtype=torch.int64, device=DEVICE), 3).tolist() == [-1, -1, -1]
