"""The one-shot collectives over peer memory (kernels/peer_collectives.py) on one GPU: a rank that never arrives
fails the launch once the timeout has passed, instead of hanging the engine."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kernel_cases import DEVICE

ABSENT_RANK = textwrap.dedent("""
    import torch
    from diffulex_kernels.peer_collectives import one_shot_all_reduce

    # Rank 0 of two, whose partner never raises its flag.
    staging = [torch.zeros(2 * 4096, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    flags = [torch.zeros(4, 2, dtype=torch.int64, device="cuda") for _ in range(2)]
    staging_offsets = torch.tensor([(s.data_ptr() - staging[0].data_ptr()) // 16 for s in staging], device="cuda")
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device="cuda")
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    one_shot_all_reduce(x, staging[0], staging_offsets, flag_ptrs, counts, 0, timeout_ns=200_000_000)
    torch.cuda.synchronize()
    print("returned")
""")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the timeout runs on a GPU's clock")
def test_a_rank_that_never_arrives_fails_the_launch_after_the_timeout():
    done = subprocess.run([sys.executable, "-c", ABSENT_RANK], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "device-side assert" in done.stderr or "a rank did not arrive in time" in done.stderr, done.stderr[-2000:]
