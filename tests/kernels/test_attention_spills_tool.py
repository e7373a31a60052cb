"""tools/attention_spills.py compiles the attention kernel for sm_90a without a GPU: the float32 launches the runner
compiles spill under a kilobyte a thread, as docs/kernels.md says, each fits shared memory, the launches over
FP8 rows compile and read no FP8 tile from shared memory a byte at a time, and those that go on from a prior spill no
more than the same tiles over a cache."""
import os
import subprocess
import sys
from pathlib import Path

from diffulex_kernels.attention import SHARED_MEMORY_BYTES

REPO = Path(__file__).resolve().parents[2]


def test_float32_launches_spill_under_a_kilobyte_a_thread():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = subprocess.run([sys.executable, str(REPO / "tools" / "attention_spills.py"), "--dtypes", "float32",
                           "--head-dims", "128,512"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| torch.float32")]
    assert len(rows) == 4  # two head sizes, unsplit and split
    for row in rows:
        stores, loads = (int(x) for x in row[4].split(" / "))
        assert stores < 1024 and loads < 1024, row
        assert int(row[5].rstrip(" |")) <= SHARED_MEMORY_BYTES, row


def test_the_launches_over_fp8_rows_compile_for_hopper_fit_shared_memory_and_load_no_bytes_one_by_one():
    """CI has no GPU: compiling for sm_90a here is what catches a kernel over FP8 rows that the interpreter runs and
    Hopper's compiler refuses (the float16 widening, the rescaled query, the scales loaded a tile ahead), or one that
    gathers a value tile from shared memory a byte a load (attention._widen_e4m3), which the interpreter cannot show
    and which made LLaDA-8B's 32-row launches over FP8 rows about a fifth slower (docs/kernels.md)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "tools" / "attention_spills.py"), "--dtypes", "bfloat16,float16",
                           "--head-dims", "64,128", "--kv-fp8"], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if " over FP8 rows | " in line]
    assert len(rows) == 2 * 2 * 9  # two dtypes, two head sizes: 16 to 128 rows, unsplit and split, the 256-row tile
    for row in rows:
        assert int(row[5]) <= SHARED_MEMORY_BYTES, row
        assert int(row[6].rstrip(" |")) == 0, row


def test_the_launches_that_go_on_from_a_prior_compile_for_hopper_and_spill_no_more_than_those_over_a_cache():
    """The launches flash_attn's wide groups take after flash-attn's context (no context loop, the prior loaded
    first) compile for sm_90a, fit shared memory, and spill no more than the same tiles over a cached context."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = [sys.executable, str(REPO / "tools" / "attention_spills.py"), "--dtypes", "bfloat16", "--head-dims", "128"]
    runs = [subprocess.run(tool + extra, capture_output=True, text=True, env=env, timeout=600)
            for extra in ([], ["--prior"])]
    assert all(done.returncode == 0 for done in runs), [done.stderr[-3000:] for done in runs]

    def unsplit(done) -> dict[str, tuple[int, int]]:  # tile -> (spill stores, shared bytes)
        rows = [line.split(" | ") for line in done.stdout.splitlines() if ", 1 split(s) | " in line]
        return {row[2]: (int(row[4].split(" / ")[0]), int(row[5])) for row in rows}

    over_cache, after_prior = unsplit(runs[0]), unsplit(runs[1])
    assert after_prior.keys() == over_cache.keys() and len(after_prior) == 5  # 16 to 128 rows, and the 256-row tile
    for tile, (stores, shared) in after_prior.items():
        assert shared <= SHARED_MEMORY_BYTES, tile
        assert stores <= over_cache[tile][0], tile
