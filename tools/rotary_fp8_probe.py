"""Where `rotate_and_store_kv` and `store_kv` part over FP8 rows: the case of
`tests/kernels/test_rotary.py::test_rotate_and_store_kv_equals_rotate_then_store[(5, 4, 2, 64)-fp8-rows-*-partial]`,
rebuilt outside pytest, printing the K cache bytes and row scales that differ, with programmatic dependent launch
and without it where the GPU has it. The compiled kernels part on a GPU; on a CPU the interpreter runs the case:

    python tools/rotary_fp8_probe.py                       # GPU
    TRITON_INTERPRET=1 python tools/rotary_fp8_probe.py    # CPU
"""
from __future__ import annotations

import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "kernels")]

from diffulex_backend.layers.rotary import rotary_angles  # noqa: E402
from diffulex_kernels import kv_store, rotary  # noqa: E402
from diffulex_kernels.kv_store import fp8_rows, pack_fp8_rows, store_kv  # noqa: E402
from kernel_cases import DEVICE, generator, randn  # noqa: E402

TOKENS, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 5, 4, 2, 64, 16


def compare(dtype: torch.dtype) -> None:
    """The test's inputs, drawn in the test's order from its seeds."""
    gen = generator(TOKENS * HEADS + 1)
    qkv = randn(TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, gen=gen)
    positions = torch.randint(0, 4096, (TOKENS,), generator=gen, device=DEVICE)
    cos, sin = rotary_angles(positions, HEAD_DIM // 4, 10000.0)
    num_pages = TOKENS // PAGE_SIZE + 2
    caches = [pack_fp8_rows(randn(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, gen=gen))
              for _ in range(2)]
    slots = torch.randperm(num_pages * PAGE_SIZE, generator=torch.Generator().manual_seed(TOKENS))[:TOKENS]
    slots[::2] = -1
    expected = [cache.clone() for cache in caches]
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(TOKENS, HEADS + KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(TOKENS, KV_HEADS, HEAD_DIM)
    rotary.rotate_and_store_kv(qk, v, cos, sin, caches[0], caches[1], slots.to(DEVICE))
    store_kv(qk[:, HEADS:], v, expected[0], expected[1], slots.to(DEVICE))
    (got, got_scale), (want, want_scale) = fp8_rows(caches[0]), fp8_rows(expected[0])
    values = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().tolist()
    scales = (got_scale != want_scale).nonzero().tolist()
    print(f"{dtype}: {len(values)} K value bytes and {len(scales)} K row scales differ", flush=True)
    for page, row, head in scales[:4]:
        slot = page * PAGE_SIZE + row
        token = slots.tolist().index(slot)
        k = qk[token, HEADS + head].float()
        print(f"  slot {slot} (token {token}) head {head}: scale {got_scale[page, row, head].item():.7g}, "
              f"store_kv's {want_scale[page, row, head].item():.7g}; "
              f"largest |K| left in qkv {k.abs().max().item():.7g}")


def main() -> int:
    probe = torch.zeros(1, device=DEVICE)
    for dependent in dict.fromkeys((rotary.use_pdl(probe), False)):
        print(f"programmatic dependent launch: {dependent}")
        if not dependent:
            rotary.use_pdl = kv_store.use_pdl = lambda tensor: False
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            compare(dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
