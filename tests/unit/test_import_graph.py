"""The engine's modules import each other without cycles, counting imports inside functions too (a deferred
import hides a cycle; it does not remove it). Imports only for type checkers are left out: they never run."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "diffulex_backend"


def module_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def runtime_nodes(tree: ast.AST):
    """Every node, except what sits under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name.split(".") if is_package else name.split(".")[:-1]
        targets = set()
        for node in runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module
                if node.level:  # relative: from the package, or `level - 1` packages above it
                    parts = package[: len(package) - node.level + 1]
                    base = ".".join(parts + [node.module] if node.module else parts)
                for alias in node.names:  # `from . import x` imports the module x
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_engine_modules_import_each_other_without_cycles():
    assert cycles(import_graph()) == []


def test_config_imports_no_strategy_and_no_engine_part():
    assert import_graph()["diffulex_backend.config"] <= {"diffulex_backend.registry"}
    assert import_graph()["diffulex_backend.registry"] == set()


def test_the_cycle_finder_finds_a_deferred_import_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
