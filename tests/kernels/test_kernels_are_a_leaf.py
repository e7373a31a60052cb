"""kernels/ takes tensors and plain values from the engine and imports nothing of it, so the engine's modules can
depend on the kernels and never the other way round."""
import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_no_kernel_module_imports_the_engine():
    sources = sorted(KERNELS.rglob("*.py"))
    assert len(sources) > 5
    offenders = {path.name: sorted(m for m in imported_modules(path) if m.split(".")[0] == "diffulex_backend")
                 for path in sources}
    assert {name: found for name, found in offenders.items() if found} == {}
