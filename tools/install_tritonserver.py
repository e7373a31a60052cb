"""Install a runnable `tritonserver` into a virtual environment from the nvidia-pytriton wheel.

The wheel carries a complete Triton Inference Server, but its Python backend is not laid out the way the
server looks for it. This builds a backend directory (`<runtime>/backends/python/`) holding
libtriton_python.so, triton_python_backend_utils.py and the stub built for this interpreter's Python
version (the server looks for the stub beside the library), and writes a `tritonserver` launcher into the
venv's bin that supplies `--backend-directory`, the wheel's shared libraries and the venv on PATH (the stub
finds its packages through the `python3` on PATH and ignores PYTHONPATH).

Usage: python tools/install_tritonserver.py RUNTIME_DIR   (run with the venv's python)
"""

import argparse
import os
import shutil
import stat
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path

import pytriton

LAUNCHER = """#!/usr/bin/env bash
# The Triton Inference Server bundled in nvidia-pytriton {version}, with this environment's Python backend.
# Written by tools/install_tritonserver.py; rerun it rather than editing this file.
set -euo pipefail
export PATH="{venv_bin}:$PATH"
export LD_LIBRARY_PATH="{library_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
exec "{server}" --backend-directory "{backends}" "$@"
"""


def python_library_dirs() -> list[str]:
    """Where the stub finds libpython for this interpreter: a shared build's own LIBDIR comes first,
    so the embedded interpreter matches the venv's standard library."""
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return [sysconfig.get_config_var("LIBDIR")]
    return []


def build_backend_dir(server_root: Path, runtime: Path) -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"nvidia-pytriton has no Python backend stub for Python {version} (looked for {stub})")
    backend = runtime / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        install_file(server_root / "backends" / "python" / name, backend / name)
    install_file(stub, backend / stub.name)
    (backend / stub.name).chmod(0o755)
    return runtime / "backends"


def install_file(source: Path, target: Path) -> None:
    """Copy beside the target, then rename over it: a server that is running keeps the old file open, and
    writing into an executable that is running fails."""
    partial = target.with_name(target.name + ".partial")
    shutil.copy2(source, partial)
    os.replace(partial, target)


def write_launcher(server_root: Path, backends: Path) -> Path:
    venv_bin = Path(sys.prefix) / "bin"
    wheel_libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    launcher = venv_bin / "tritonserver"
    launcher.write_text(
        LAUNCHER.format(
            version=version("nvidia-pytriton"),
            venv_bin=venv_bin,
            library_path=os.pathsep.join(python_library_dirs() + [str(wheel_libs)]),
            server=server_root / "bin" / "tritonserver",
            backends=backends.resolve(),
        )
    )
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return launcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runtime", type=Path, help="folder to hold the backend directory")
    args = parser.parse_args()
    if sys.prefix == sys.base_prefix:
        raise SystemExit("run this with a virtual environment's python: the launcher goes into its bin")
    server_root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    backends = build_backend_dir(server_root, args.runtime)
    print(f"wrote {write_launcher(server_root, backends)} (backends in {backends})")


if __name__ == "__main__":
    main()
