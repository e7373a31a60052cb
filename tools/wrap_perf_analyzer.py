"""Make the virtual environment's perf_analyzer run as it is: tritonclient's binary links libcudart.so.12, which
PyPI's nvidia-cuda-runtime-cu12 provides in site-packages, off the loader's path.

    python tools/wrap_perf_analyzer.py .venv/bin

moves the binary to perf_analyzer.bin and writes, in its place, a shell wrapper that puts that library folder on
LD_LIBRARY_PATH and runs it. Run again, it rewraps a binary that a reinstall of tritonclient put back, and leaves a
wrapper alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nvidia.cuda_runtime

WRAPPER = """#!/bin/sh
# tritonclient's perf_analyzer (perf_analyzer.bin beside this file) with nvidia-cuda-runtime-cu12's libcudart.so.12
# on the library path. Written by tools/wrap_perf_analyzer.py.
LD_LIBRARY_PATH="{lib}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "$(dirname "$0")/perf_analyzer.bin" "$@"
"""


def main(bin_dir: str) -> int:
    binary = Path(bin_dir) / "perf_analyzer"
    if not binary.is_file():
        print(f"{binary} is missing: install tritonclient[all]", file=sys.stderr)
        return 1
    if binary.read_bytes()[:4] != b"\x7fELF":
        return 0  # already a wrapper
    lib = ":".join(str(Path(folder) / "lib") for folder in nvidia.cuda_runtime.__path__)
    binary.replace(binary.with_name("perf_analyzer.bin"))
    binary.write_text(WRAPPER.format(lib=lib))
    binary.chmod(0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
