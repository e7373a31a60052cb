"""The engine runs with the kernels of its own tree.

The project's packages sit side by side. In a source tree they are diffulex_backend/, kernels/ and client/, and
the import names of the last two, diffulex_kernels and diffulex_client, are links in the tree's root (the prefix
because transformers probes for a Hugging Face package called `kernels`), so a process with the tree's root on
its path imports all three from that tree. An installed distribution holds the three under their import names.
Either way, with links resolved, the kernels' folder is beside the engine's.

A process can still find the engine in one place and the kernels in another: a second checkout run by a Python
whose editable install points at the first, or a path that lists two trees. It would then run one tree's engine
with the other's kernels without a sign, so importing the engine checks where the kernels are before any is used.
The check locates them without importing them, since importing them imports Triton.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path


def check_kernels_beside_engine() -> None:
    spec = importlib.util.find_spec("diffulex_kernels")
    if spec is None or spec.origin is None:
        return  # a tree without its kernels: the first kernel the engine asks for raises ImportError
    engine = Path(__file__).resolve().parent
    kernels = Path(spec.origin).resolve().parent
    if kernels.parent != engine.parent:
        raise ImportError(
            f"diffulex_kernels comes from {kernels}, but the engine from {engine}: the engine runs only with the "
            f"kernels of its own tree. Put one tree's root first on the path (run from it, or set PYTHONPATH to it), "
            f"or install the project (pip install .)")
