"""The code's shape, read from its imports with `ast`: three floors, loadtest -> deployments
-> engine, with no arrow up and no import circle; no private name (`_x`) imported from
another file; no function longer than a screen."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("engine", "deployments", "loadtest")  # each may import only those before it and itself
MAX_FUNCTION_LINES = 40


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(packages: tuple[str, ...] = FLOORS) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, at any depth, but those under `if TYPE_CHECKING:` (annotations only:
    never imported when the code runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def project_imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every import of this project's code that
    runs, at any depth (imports inside functions count too)."""
    for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            modules, names = [alias.name for alias in node.names], []
        else:
            continue
        for module in modules:
            if module.split(".")[0] in (*FLOORS, "tests"):
                yield module, names, node.lineno


def floor(module: str) -> int:
    return FLOORS.index(module.split(".")[0])


def resolve(module: str, names: list[str], known: set[str]) -> list[str]:
    """The project modules an import loads: `from engine import outputs` loads engine.outputs."""
    submodules = [f"{module}.{name}" for name in names if f"{module}.{name}" in known]
    return [module, *submodules] if module in known else submodules


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    known = {module_name(p) for p in files}
    return {module_name(p): {m for module, names, _ in project_imports(p) for m in resolve(module, names, known)}
            for p in files}


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_points_up_a_floor(path: Path) -> None:
    here = floor(module_name(path))
    upward = [f"line {line}: {module}" for module, _, line in project_imports(path)
              if module.split(".")[0] == "tests" or floor(module) > here]
    assert upward == [], f"{FLOORS[here]} may import only {FLOORS[: here + 1]}"


# Test files that specify one module's private pieces directly (a fast path against its
# definition): each may reach into that module only.
PRIVATE_ACCESS = {"tests/test_sampling.py": "engine.sampler", "tests/test_decode_attention.py": "engine.attention"}


@pytest.mark.parametrize("path", source_files((*FLOORS, "tests")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_is_imported_from_another_file(path: Path) -> None:
    allowed = PRIVATE_ACCESS.get(str(path.relative_to(ROOT)))
    private = [f"line {line}: {module}.{name}" for module, names, line in project_imports(path)
               for name in names if name.startswith("_") and module != allowed]
    assert private == []


def test_there_is_no_import_circle() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, "import circle: " + " -> ".join([*path[path.index(module):], module])
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_function_fits_on_a_screen(path: Path) -> None:
    long = [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], "a long function is a missing name"
