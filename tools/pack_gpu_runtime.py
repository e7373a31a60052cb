"""Pack a tritonserver for a GPU machine that has no tritonserver and no network, and install it there.

A GPU image that ships PyTorch but no Triton Inference Server can still serve this repository: the server, the
Python backend and its stub come from the nvidia-pytriton wheel, which `make setup` installs here. Two steps:

    python tools/pack_gpu_runtime.py pack [--out .gpu-runtime] [--python-version 3.12] [--flash-attn "REQS"]
                                          [--perf-analyzer]
        Here, with the development venv: writes OUT/tritonserver.tar.xz (bin/tritonserver, backends/python/ with
        the stub of the target's Python version, lib/ = the wheel's shared libraries without libpython3*, which
        the target's own Python provides) and OUT/wheels/ (numpy 1.26.4 for that Python, py-spy, and tritonclient's
        gRPC client with what it needs beyond the image: python-rapidjson and protobuf 4; the OpenAI front's
        fastapi and uvicorn with their dependencies), downloaded with pip unless already there. tritonclient's wheel is repacked without its perf_analyzer binaries (40 MB). About
        50 MB in all, small enough to travel with a checkout. With --flash-attn (as `make gpu-runtime` runs it),
        also OUT/flash-attn/: flash-attn's Hopper kernels and the CuTe DSL they compile with, about 100 MB more.
        With --perf-analyzer (as `make gpu-runtime` runs it), also OUT/perf-analyzer/: the perf_analyzer binary of
        this venv's tritonclient with the two libraries a GPU image may lack (libcudart.so.12 from
        nvidia-cuda-runtime-cu12, libb64.so.0d), about 21 MB, for `benchmarks/data_parallel.py` and `make perf`.

    python3 tools/pack_gpu_runtime.py install [--runtime .gpu-runtime] [--prefix /tmp/sv]
        There, with the image's python3 (the one that holds torch): unpacks the server into PREFIX/tritonserver,
        makes a venv PREFIX of the system Python with numpy 1.26.4 (and flash-attn, where packed) in it, links
        every entry of the image's
        site-packages except numpy, scipy and scikit-learn into PREFIX/image-site, and this checkout's three import
        names (diffulex_backend, and the root's links diffulex_kernels and diffulex_client) into PREFIX/project,
        both added to the venv by a .pth file; writes
        PREFIX/bin/tritonserver (the launcher that diffulex_client.perf.tritonserver expects beside python) and
        PREFIX/bin/py-spy, and where packed PREFIX/bin/perf_analyzer (a wrapper that puts its libraries on the
        loader's path). Then run the benchmark or the server tests with PREFIX/bin/python.

Why a second venv: the Python backend's stub breaks every BYTES input under numpy 2 ("unpack_from requires a
buffer ..."), so the stub's Python needs numpy < 2; the image's scipy and scikit-learn are built against numpy 2
and would break transformers' lazy imports under 1.26, so they are left out. The stub ignores PYTHONPATH and
finds its packages through the `python3` first on PATH, which the launcher puts there. The checkout's import names
are linked rather than adding the checkout's root to the path, where transformers would find kernels/ under the name
of a Hugging Face package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import site
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUNTIME = REPOSITORY_ROOT / ".gpu-runtime"
ARCHIVE = "tritonserver.tar.xz"
NUMPY_VERSION = "1.26.4"
PY_SPY_VERSION = "0.4.3"
TRITONCLIENT_VERSION = "2.51.0"
# The OpenAI front's server, with everything it needs: `benchmarks/serving.py --front` runs it on the GPU machine.
FRONT_REQUIREMENTS = ("fastapi==0.163.2", "uvicorn==0.54.0")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_5_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_28_x86_64", "manylinux1_x86_64", "any")
# The image's packages that are built against numpy 2 (or are numpy), and so stay out of the stub's path.
LEFT_OUT_PREFIXES = ("numpy", "scipy", "sklearn", "scikit_learn")
# flash-attn's wheels, in a folder of the runtime of their own.
FLASH_ATTN_FOLDER = "flash-attn"
# perf_analyzer and the libraries it links that a GPU image may not have, in a folder of their own.
PERF_ANALYZER_FOLDER = "perf-analyzer"
PERF_ANALYZER_LIBRARIES = ("libcudart.so.12", "libb64.so.0d")
PERF_ANALYZER_WRAPPER = """#!/bin/sh
# perf_analyzer with the libraries packed beside it on the loader's path (tools/pack_gpu_runtime.py).
LD_LIBRARY_PATH="{folder}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "{folder}/perf_analyzer" "$@"
"""
# This checkout's packages, as its root names them for import.
PROJECT_PACKAGES = ("diffulex_backend", "diffulex_kernels", "diffulex_client")

LAUNCHER = """#!/usr/bin/env bash
# Triton Inference Server from nvidia-pytriton, packed by tools/pack_gpu_runtime.py, with this venv's Python.
set -euo pipefail
export PATH="{venv_bin}:$PATH"
export LD_LIBRARY_PATH="{lib}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
exec "{server}" --backend-directory "{backends}" "$@"
"""


# ---- pack (on the development machine) --------------------------------------------------------------------
def pytriton_root() -> tuple[Path, Path]:
    """The installed wheel's server folder and its shared libraries."""
    try:
        import pytriton
    except ImportError:
        raise SystemExit("nvidia-pytriton is not installed in this Python: run `make setup` first") from None
    package = Path(pytriton.__file__).resolve().parent
    return package / "tritonserver", package.parent / "nvidia_pytriton.libs"


def pack_server(out: Path, python_version: str) -> Path:
    server_root, libs = pytriton_root()
    stub = server_root / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"nvidia-pytriton has no stub for Python {python_version} (looked for {stub})")
    members = [(server_root / "bin" / "tritonserver", "bin/tritonserver")]
    members += [(server_root / "backends" / "python" / name, f"backends/python/{name}")
                for name in ("libtriton_python.so", "triton_python_backend_utils.py")]
    members.append((stub, f"backends/python/{stub.name}"))
    members += [(path, f"lib/{path.name}") for path in sorted(libs.iterdir())
                if path.is_file() and not path.name.startswith("libpython3")]
    archive = out / ARCHIVE
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for path, name in members:
            info = tar.gettarinfo(str(path), arcname=name)
            if name.startswith("bin/") or name.endswith("_stub"):
                info.mode |= stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
            with open(path, "rb") as f:
                tar.addfile(info, f)
    os.replace(partial, archive)
    return archive


def download_wheels(out: Path, python_version: str) -> list[Path]:
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # tritonclient 2.51's generated gRPC code needs protobuf < 5; the image may hold a newer one.
    wanted = {"numpy": f"numpy=={NUMPY_VERSION}", "py_spy": f"py-spy=={PY_SPY_VERSION}",
              "python_rapidjson": "python-rapidjson==1.25", "protobuf": "protobuf==4.25.9",
              "tritonclient": f"tritonclient=={TRITONCLIENT_VERSION}"}
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    download = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--quiet", "--python-version",
                python_version, *platforms, "-d", str(wheels)]
    for prefix, requirement in wanted.items():
        if any(wheels.glob(f"{prefix}-*.whl")):
            continue
        subprocess.run([*download, "--no-deps", requirement], check=True)
        if prefix == "tritonclient":
            (wheel,) = wheels.glob("tritonclient-*.whl")
            without_binaries(wheel)
    if not any(wheels.glob("fastapi-*.whl")):
        subprocess.run([*download, *FRONT_REQUIREMENTS], check=True)
    return sorted(wheels.glob("*.whl"))


def without_binaries(wheel: Path) -> None:
    """The wheel without its data/bin folder (perf_analyzer, twice): the Python client is all the check needs."""
    slim = wheel.with_name(wheel.name + ".partial")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            if ".data/data/bin/" not in member.filename:
                target.writestr(member, source.read(member))
    os.replace(slim, wheel)


def download_flash_attn(out: Path, python_version: str, requirements: list[str]) -> list[Path]:
    """flash-attn's Hopper kernels (the flash-attn-4 package and the CuTe DSL it compiles with), without their
    dependencies the image holds (torch, einops, cuda-bindings): OUT/flash-attn, kept apart from the server's
    runtime since it is twice its size."""
    folder = out / FLASH_ATTN_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    for requirement in requirements:
        prefix = requirement.split("==")[0].replace("-", "_")
        if not any(folder.glob(f"{prefix}-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--quiet", "--no-deps",
                            "--python-version", python_version, *platforms, "-d", str(folder), requirement],
                           check=True)
    return sorted(folder.glob("*.whl"))


def pack_perf_analyzer(out: Path, bin_dir: Path = Path(sys.executable).parent) -> list[Path]:
    """OUT/perf-analyzer/: this venv's perf_analyzer binary (behind tools/wrap_perf_analyzer.py's wrapper when
    `make setup` wrapped it) and the libraries of PERF_ANALYZER_LIBRARIES it links, found as the loader finds them
    with the wrapper's path."""
    binary = bin_dir / "perf_analyzer.bin"
    if not binary.is_file():
        binary = bin_dir / "perf_analyzer"
    if not binary.is_file() or binary.read_bytes()[:4] != b"\x7fELF":
        raise SystemExit(f"no perf_analyzer binary in {bin_dir}: run `make setup` first")
    folder = out / PERF_ANALYZER_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, folder / "perf_analyzer")
    import nvidia.cuda_runtime

    search = os.pathsep.join(str(Path(p) / "lib") for p in nvidia.cuda_runtime.__path__)
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True,
                            env={**os.environ, "LD_LIBRARY_PATH": search}).stdout
    paths = {line.split()[0]: line.split()[2] for line in linked.splitlines() if "=> /" in line}
    for name in PERF_ANALYZER_LIBRARIES:
        if name not in paths:
            raise SystemExit(f"perf_analyzer links no {name} on this machine: run `make setup` first")
        shutil.copy2(paths[name], folder / name)
    return sorted(folder.iterdir())


def install_perf_analyzer(runtime: Path, prefix: Path) -> Path | None:
    """PREFIX/bin/perf_analyzer, where the runtime has it: the binary and its libraries in PREFIX/perf-analyzer."""
    packed = runtime / PERF_ANALYZER_FOLDER
    if not (packed / "perf_analyzer").is_file():
        return None
    folder = prefix / PERF_ANALYZER_FOLDER
    shutil.copytree(packed, folder, dirs_exist_ok=True)
    (folder / "perf_analyzer").chmod(0o755)
    wrapper = prefix / "bin" / "perf_analyzer"
    wrapper.write_text(PERF_ANALYZER_WRAPPER.format(folder=folder))
    wrapper.chmod(0o755)
    return wrapper


def pack(args: argparse.Namespace) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    archive = pack_server(out, args.python_version)
    wheels = download_wheels(out, args.python_version)
    if args.flash_attn:
        wheels += download_flash_attn(out, args.python_version, args.flash_attn.split())
    if args.perf_analyzer:
        wheels += pack_perf_analyzer(out)
    (out / "python-version").write_text(args.python_version + "\n")
    total = sum(path.stat().st_size for path in [archive, *wheels])
    for path in [archive, *wheels]:
        print(f"{path.stat().st_size / 2**20:7.1f} MiB  {path}")
    print(f"{total / 2**20:7.1f} MiB in all")


# ---- install (on the GPU machine) -------------------------------------------------------------------------
def extract_wheel(wheel: Path, site_packages: Path, bin_dir: Path) -> None:
    """A plain wheel install (no pip needed): the package into site-packages (with what the wheel's data folder
    puts under purelib or platlib), its scripts into bin."""
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.infolist():
            parts = Path(member.filename).parts
            if len(parts) >= 3 and parts[0].endswith(".data") and parts[1] == "scripts":
                target = bin_dir / parts[-1]
                target.write_bytes(zf.read(member))
                target.chmod(0o755)
            elif len(parts) >= 3 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                target = site_packages.joinpath(*parts[2:])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
            elif not parts[0].endswith(".data"):
                zf.extract(member, site_packages)


def venv_site_packages(prefix: Path) -> Path:
    (found,) = prefix.glob("lib/python3*/site-packages")
    return found


def link_entries(source: Path, target: Path, skip=lambda name: False) -> int:
    target.mkdir(parents=True, exist_ok=True)
    count = 0
    for entry in sorted(source.iterdir()):
        if skip(entry.name) or (target / entry.name).exists():
            continue
        (target / entry.name).symlink_to(entry)
        count += 1
    return count


def install(args: argparse.Namespace) -> None:
    runtime, prefix = args.runtime.resolve(), args.prefix.resolve()
    server = prefix / "tritonserver"
    if prefix.exists():
        shutil.rmtree(prefix)
    subprocess.run([args.base_python, "-m", "venv", "--without-pip", str(prefix)], check=True)
    version = subprocess.run([str(prefix / "bin" / "python"), "-c", "import sys;print(*sys.version_info[:2],sep='.')"],
                             check=True, capture_output=True, text=True).stdout.strip()
    packed_for = (runtime / "python-version").read_text().strip()
    if version != packed_for:
        raise SystemExit(f"{args.base_python} is Python {version}, but the runtime was packed for {packed_for}")
    server.mkdir(parents=True)
    with tarfile.open(runtime / ARCHIVE) as tar:
        tar.extractall(server)
    site_packages = venv_site_packages(prefix)
    for wheel in [*sorted((runtime / "wheels").glob("*.whl")), *sorted((runtime / FLASH_ATTN_FOLDER).glob("*.whl"))]:
        extract_wheel(wheel, site_packages, prefix / "bin")
    image_site = Path(args.image_site_packages or site.getsitepackages()[0]).resolve()
    linked = link_entries(image_site, prefix / "image-site",
                          skip=lambda name: name.lower().startswith(LEFT_OUT_PREFIXES))
    project = prefix / "project"
    project.mkdir()
    for name in PROJECT_PACKAGES:
        (project / name).symlink_to(REPOSITORY_ROOT / name)
    # The project first: an installed copy of this project in the image must not shadow the checkout.
    (site_packages / "zz_gpu_runtime.pth").write_text(
        f"import sys; sys.path.insert(0, {str(project)!r})\n"
        f"import site; site.addsitedir({str(prefix / 'image-site')!r})\n")
    # The stub embeds the system Python: its libpython comes from that Python's LIBDIR.
    libdir = subprocess.run([args.base_python, "-c", "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))"],
                            check=True, capture_output=True, text=True).stdout.strip()
    launcher = prefix / "bin" / "tritonserver"
    launcher.write_text(LAUNCHER.format(venv_bin=prefix / "bin", lib=f"{server / 'lib'}:{libdir}",
                                        server=server / "bin" / "tritonserver", backends=server / "backends"))
    launcher.chmod(0o755)
    # The project's command, as `pip install` makes it (pyproject's [project.scripts]).
    client_command = prefix / "bin" / "diffulex-client"
    client_command.write_text(f"#!{prefix / 'bin' / 'python'}\nimport sys\nfrom diffulex_client.cli import main\n"
                              "sys.exit(main())\n")
    client_command.chmod(0o755)
    install_perf_analyzer(runtime, prefix)
    check = subprocess.run([str(prefix / "bin" / "python"), "-c", (
                            "import numpy, torch, transformers, diffulex_backend, diffulex_kernels;"
                            "from diffulex_backend.flash_attention import flash_attn_installed;"
                            "print('numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', "
                            "transformers.__version__, 'cuda', torch.cuda.is_available(), 'flash-attn', "
                            "flash_attn_installed())")],
                           capture_output=True, text=True, check=False)
    print(f"linked {linked} entries of {image_site}; {check.stdout.strip() or check.stderr[-2000:]}")
    if check.returncode != 0:
        raise SystemExit("the runtime's python cannot import the project")
    print(f"installed: {launcher}; run the benchmark with {prefix / 'bin' / 'python'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack_parser = commands.add_parser("pack", help="build the runtime folder here")
    pack_parser.add_argument("--out", type=Path, default=DEFAULT_RUNTIME)
    pack_parser.add_argument("--python-version", default="3.12", help="the GPU image's Python (major.minor)")
    pack_parser.add_argument("--flash-attn", default="", help="flash-attn's pinned requirements, space-separated "
                             "(the Makefile's FLASH_ATTN_PACKAGES); empty: leave it out")
    pack_parser.add_argument("--perf-analyzer", action="store_true", help="also perf_analyzer and its libraries")
    install_parser = commands.add_parser("install", help="install it on the GPU machine")
    install_parser.add_argument("--runtime", type=Path, default=DEFAULT_RUNTIME)
    install_parser.add_argument("--prefix", type=Path, default=Path(tempfile.gettempdir()) / "diffulex-gpu-runtime")
    install_parser.add_argument("--base-python", default="/usr/bin/python3",
                                help="the system Python the venv is made from (same version as the image's)")
    install_parser.add_argument("--image-site-packages", help="default: this Python's site-packages")
    args = parser.parse_args(argv)
    pack(args) if args.command == "pack" else install(args)


if __name__ == "__main__":
    main()
