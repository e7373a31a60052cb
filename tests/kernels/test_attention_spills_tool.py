"""tools/attention_spills.py compiles the attention kernel for sm_90a without a GPU: the float32 launches the runner
compiles spill under a kilobyte a thread, as docs/kernels.md says, and each fits shared memory."""
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
