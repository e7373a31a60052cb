"""The engine's modules import each other without cycles, counting imports inside functions too (a deferred
import hides a cycle; it does not remove it), and counting the packages an import runs: importing `a.b.c` first
imports `a.b` and `a`, whose `__init__` may import more. Imports only for type checkers never run, but a circle
through them is still two modules that need each other: they are counted too."""
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


def runtime_nodes(tree: ast.AST, type_only: bool = False):
    """Every node, except what sits under `if TYPE_CHECKING:` unless `type_only` asks for that too."""
    for node in ast.iter_child_nodes(tree):
        if (not type_only and isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            continue
        yield node
        yield from runtime_nodes(node, type_only)


def with_packages(targets: set[str], importer: str, modules) -> set[str]:
    """The modules importing `targets` runs: each target and the packages above it, except the packages the
    importer itself is inside (Python has begun importing those before the importer runs)."""
    inside = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    ran = set()
    for target in targets:
        parts = target.split(".")
        ran.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in ran - inside if m in modules}


def import_graph(packages: bool = True, type_only: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name.split(".") if is_package else name.split(".")[:-1]
        targets = set()
        for node in runtime_nodes(ast.parse(path.read_text()), type_only):
            if isinstance(node, ast.ImportFrom):
                base = node.module
                if node.level:  # relative: from the package, or `level - 1` packages above it
                    parts = package[: len(package) - node.level + 1]
                    base = ".".join(parts + [node.module] if node.module else parts)
                for alias in node.names:  # `from . import x` imports the module x
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        targets = {t for t in targets if t in modules}
        graph[name] = (with_packages(targets, name, modules) if packages else targets) - {name}
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


def test_no_two_modules_need_each_other_even_for_type_checkers():
    assert cycles(import_graph(type_only=True)) == []


def test_layers_and_the_tensor_parallel_plan_never_import_the_model_families():
    graph = import_graph()
    lower = [name for name in graph if name.startswith("diffulex_backend.layers") or name in (
        "diffulex_backend.tensor_parallel", "diffulex_backend.arch", "diffulex_backend.tokenizer")]
    assert {name: sorted(t for t in graph[name] if t.startswith("diffulex_backend.models"))
            for name in lower} == {name: [] for name in lower}


def test_config_imports_no_strategy_and_no_engine_part():
    graph = import_graph()
    assert graph["diffulex_backend.config"] <= {"diffulex_backend.registry", "diffulex_backend.sampling"}
    assert graph["diffulex_backend.registry"] <= {"diffulex_backend.sampling"}
    assert graph["diffulex_backend.sampling"] <= {"diffulex_backend.refusal"}


def imported_from(roots: set[str], graph: dict[str, set[str]]) -> set[str]:
    """Every module that importing `roots` can run, deferred imports included."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def test_the_engine_never_imports_the_checkpoint_writer_or_its_config_files():
    # The package itself, what Triton's model.py imports, and what a tensor-parallel rank runs.
    engine = imported_from({"diffulex_backend", "diffulex_backend.serving.triton_adapter", "diffulex_backend.workers"},
                           import_graph())
    assert "diffulex_backend.engine" in engine and "diffulex_backend.models.llada" in engine
    assert sorted(name for name in engine if name.startswith("diffulex_backend.testing")) == []


def test_the_cycle_finder_finds_a_deferred_import_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_an_import_runs_the_packages_above_its_target_but_not_the_importers_own():
    modules = {"p", "p.q", "p.q.r", "p.s", "t"}
    assert with_packages({"p.q.r"}, "p.s", modules) == {"p.q", "p.q.r"}
    assert with_packages({"p.q.r", "t"}, "u", modules) == {"p", "p.q", "p.q.r", "t"}
