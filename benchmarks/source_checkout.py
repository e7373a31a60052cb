"""Lets a benchmark run from a checkout that is not pip-installed (as on a bare GPU machine): maps the import name
`diffulex_kernels` onto the `kernels/` folder, as pyproject's package-dir does. Run with the repository root on
PYTHONPATH for `diffulex_backend`."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile


def map_kernels_package() -> None:
    if importlib.util.find_spec("diffulex_kernels") is not None:
        return
    # A folder on sys.path with a link named diffulex_kernels, rather than an entry in sys.modules, so that the
    # processes the engine starts (tensor-parallel ranks, which get this sys.path) import it too.
    kernels = pathlib.Path(__file__).resolve().parents[1] / "kernels"
    folder = pathlib.Path(tempfile.mkdtemp(prefix="diffulex-kernels-"))
    (folder / "diffulex_kernels").symlink_to(kernels, target_is_directory=True)
    sys.path.insert(0, str(folder))
