"""Lets a benchmark run from a checkout that is not pip-installed (as on a bare GPU machine): maps the import name
`diffulex_kernels` onto the `kernels/` folder, as pyproject's package-dir does. Run with the repository root on
PYTHONPATH for `diffulex_backend`."""
from __future__ import annotations

import importlib.util
import pathlib
import sys


def map_kernels_package() -> None:
    if importlib.util.find_spec("diffulex_kernels") is not None:
        return
    kernels = pathlib.Path(__file__).resolve().parents[1] / "kernels"
    spec = importlib.util.spec_from_file_location("diffulex_kernels", kernels / "__init__.py",
                                                  submodule_search_locations=[str(kernels)])
    sys.modules["diffulex_kernels"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["diffulex_kernels"])
