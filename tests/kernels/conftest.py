"""Shared setup for the kernel tests.

Without a GPU the kernels run under Triton's interpreter at small shapes; `DIFFULEX_FULL_SHAPES=1` (on a
GPU machine) runs the same tests at the shapes of the served models.
"""
import importlib.util
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    # Must be set before any kernel is defined: triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("diffulex_kernels") is None:
    # Not installed: map the import name onto the source folder, as pyproject's package-dir does.
    kernels_dir = pathlib.Path(__file__).resolve().parents[2] / "kernels"
    spec = importlib.util.spec_from_file_location(
        "diffulex_kernels", kernels_dir / "__init__.py", submodule_search_locations=[str(kernels_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["diffulex_kernels"] = module
    spec.loader.exec_module(module)
