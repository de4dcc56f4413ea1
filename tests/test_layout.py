"""The code's shape, read from its imports with `ast`: four floors, bench -> loadtest ->
deployments -> engine (bench/ outside the wheel), and inside each floor its rooms (sub-packages) in an order, with no arrow up and
no import circle; every room says its job; no private name (`_x`) imported from another
file; no function longer than a screen. Each rule is one test that lists every breach."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("engine", "deployments", "loadtest", "bench")  # each may import only those before it and itself
SHIPPED = ("engine", "deployments", "loadtest")  # the wheel's packages; bench/ stays in the repository
# Each floor's rooms, lowest first: a module may import its own room and those before it.
# A room is a sub-package, or a top-level module named here (engine/config.py); the floor's
# other top-level modules (deployments/app.py, loadtest's tools) are the room named as the floor.
ROOMS = {
    "engine": ("engine.request", "engine.kernels", "engine.lora", "engine.model", "engine.sampling", "engine.speculative",
               "engine.config",
               "engine.core", "engine.frontend", "engine"),
    "deployments": ("deployments.observability", "deployments.routing", "deployments.api", "deployments.replicas",
                    "deployments"),
    "loadtest": ("loadtest.client", "loadtest.chaos", "loadtest.scale", "loadtest"),
    "bench": ("bench.peers", "bench.scale", "bench", "bench.micro"),
}
# The room that needs no torch: the processes that only check requests import it alone.
NO_TORCH = "engine.request"
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
    """The project modules an import loads: `from engine.request import outputs` loads engine.request.outputs."""
    submodules = [f"{module}.{name}" for name in names if f"{module}.{name}" in known]
    return [module, *submodules] if module in known else submodules


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    known = {module_name(p) for p in files}
    return {module_name(p): {m for module, names, _ in project_imports(p) for m in resolve(module, names, known)}
            for p in files}


def room(module: str) -> str:
    parts = module.split(".")
    named = ".".join(parts[:2])
    is_room = len(parts) > 1 and ((ROOT / parts[0] / parts[1]).is_dir() or named in ROOMS[parts[0]])
    return named if is_room else parts[0]


def room_rank(module: str) -> int:
    return ROOMS[module.split(".")[0]].index(room(module))


def breaches(check) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {module}" for path in source_files()
            for module, names, line in project_imports(path) if check(module_name(path), module)]


def test_no_import_points_up_a_floor() -> None:
    upward = breaches(lambda here, there: there.split(".")[0] == "tests" or floor(there) > floor(here))
    assert upward == [], f"each of {FLOORS} may import only those before it"


def test_the_wheel_ships_the_three_lower_floors_alone_and_no_sitecustomize() -> None:
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{package}*" for package in SHIPPED)
    assert [str(p.relative_to(ROOT)) for p in source_files(SHIPPED) if p.name == "sitecustomize.py"] == []


def test_no_import_points_up_a_room() -> None:
    upward = breaches(lambda here, there: there.split(".")[0] == here.split(".")[0] and room_rank(there) > room_rank(here))
    assert upward == [], f"each floor's rooms, lowest first: {ROOMS}"


def test_every_module_is_in_a_room_and_every_room_says_its_job() -> None:
    homeless = [module_name(p) for p in source_files() if room(module_name(p)) not in ROOMS[module_name(p).split(".")[0]]]
    silent = [str(p.relative_to(ROOT)) for p in source_files() if p.name == "__init__.py"
              and not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert (homeless, silent) == ([], [])


def test_the_request_room_runs_without_torch() -> None:
    heavy = [f"{p.relative_to(ROOT)}: {alias.name}" for p in (ROOT / "engine" / "request").rglob("*.py")
             for node in runtime_nodes(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(node, ast.Import)
             for alias in node.names if alias.name.split(".")[0] in ("torch", "numpy", "transformers")]
    outside = breaches(lambda here, there: room(here) == NO_TORCH and room(there) != NO_TORCH)
    assert (heavy, outside) == ([], [])


# Test files that specify one module's private pieces directly (a fast path against its
# definition): each may reach into that module only.
PRIVATE_ACCESS = {"tests/test_sampling.py": "engine.sampling.sampler", "tests/test_decode_attention.py": "engine.model.attention"}


def test_no_private_name_is_imported_from_another_file() -> None:
    private = [f"{path.relative_to(ROOT)}:{line}: {module}.{name}" for path in source_files((*FLOORS, "tests"))
               for module, names, line in project_imports(path) for name in names
               if name.startswith("_") and module != PRIVATE_ACCESS.get(str(path.relative_to(ROOT)))]
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


def test_every_function_fits_on_a_screen() -> None:
    long = [f"{path.relative_to(ROOT)}: {node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for path in source_files() for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], "a long function is a missing name"
