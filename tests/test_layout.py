"""The layout of ``service/`` and ``models/`` read from their imports (issue 26): packages named for
the process that runs them, no import circle, no module importing another's private names.

- ``service.common`` (both processes) imports neither ``service.engine`` nor ``service.frontend``
  nor what sits above them (the supervisor, the CLI);
- ``service.engine`` imports nothing of the front ends or the web app (FastAPI, Starlette,
  uvicorn); ``service.frontend`` imports nothing of the engine;
- every import counts, including those inside functions (a lazy import still binds the layers).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("service", "models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()

# No exceptions: the last two circles (issue 35) were closed by moving what both sides read below
# them (models.evaluation.scores, models.training.loss). Any circle that appears fails.
KNOWN_PRIVATE: set[tuple[str, str]] = set()
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except what sits under ``if TYPE_CHECKING:`` (never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(
    name: str, path: Path, *, type_checking: bool = False
) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in ``path``, relative ones
    resolved; those under ``if TYPE_CHECKING:`` too when ``type_checking``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if type_checking else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target, [alias.name for alias in node.names], node.lineno


def _edges() -> dict[str, set[str]]:
    """Module → project modules it imports (``from pkg import sub`` counts as importing pkg.sub)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = graph.setdefault(name, set())
        for target, names, _ in _imports(name, path):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if subs:
                deps.update(subs)
            elif target in MODULES and target != name:
                deps.add(target)
    return graph


def test_no_private_name_crosses_modules() -> None:
    """Type-only imports count: a private name used as another module's type is part of its API."""
    crossings = []
    for name, path in MODULES.items():
        for target, names, line in _imports(name, path, type_checking=True):
            if not target.startswith(ROOTS) or target == name:
                continue
            for n in names:
                where = str(path.relative_to(REPO))
                if n.startswith("_") and not n.startswith("__") and (where, n) not in KNOWN_PRIVATE:
                    crossings.append(f"{where}:{line} imports {n} from {target}")
    assert not crossings, "\n".join(crossings)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_has_no_circle() -> None:
    graph = _edges()
    for a, b in KNOWN_CIRCLE_EDGES:
        graph[a].discard(b)
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


FORBIDDEN = {
    "service.common": ("service.engine", "service.frontend", "service.supervisor", "service.cli",
                       "service.backlog", "fastapi", "starlette", "uvicorn"),
    "service.engine": ("service.frontend", "fastapi", "starlette", "uvicorn"),
    "service.frontend": ("service.engine",),
}  # fmt: skip


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_process_packages_keep_to_their_side(package: str) -> None:
    assert any(m.startswith(f"{package}.") for m in MODULES), f"{package} has no modules"
    wrong = []
    for name, path in MODULES.items():
        if name != package and not name.startswith(f"{package}."):
            continue
        for target, _, line in _imports(name, path):
            for banned in FORBIDDEN[package]:
                if target == banned or target.startswith(f"{banned}."):
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_service_top_level_is_small() -> None:
    """Beside the process packages, only the supervisor (and what it runs itself) and the CLI."""
    top = sorted(p.name for p in (REPO / "service").iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "backlog.py", "supervisor.py"], top


def test_the_engine_process_loads_no_web_app() -> None:
    """Importing the engine's modules (with everything they import) loads no FastAPI, Starlette or
    uvicorn: the engine process runs no web app."""
    import subprocess

    code = (
        "import sys, service.engine.engine, service.engine.batcher, service.engine.jobs, "
        "service.engine.model_manager, service.engine.drift; "
        "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _loaded(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded after running ``code``."""
    import subprocess

    code += (
        f"; import json, sys; print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_start_up_imports_only_what_each_step_needs() -> None:
    """What keeps ``vge serve``'s start short (service/supervisor.py, ``run``): validating the
    settings imports no torch (the engine is spawned right after), and the engine, with its model
    loaded and a batch run, imports neither torchvision (whose import pulls torch._dynamo, 1.7 s)
    nor scikit-learn or SciPy (1.1 s)."""
    assert _loaded("import service.cli.serve, service.common.settings", ("torch",)) == []
    engine = (
        "import torch, service.engine.engine, service.engine.batcher, service.engine.jobs, "
        "service.engine.model_manager, service.engine.drift; "
        "from models.predictor import Predictor; "
        "p = Predictor.from_dir('models/zoo/cnn4-lle-vgn-mnist', device='cpu'); "
        "p.run([torch.zeros(2, 1, 28, 28, dtype=torch.uint8)])"
    )
    assert _loaded(engine, ("torchvision", "sklearn")) == []


def test_models_evaluation_exports_what_it_lists() -> None:
    """models.evaluation loads its public names on first use (PEP 562): ``__all__`` lists exactly
    the names it maps, and each is its defining module's object (no name is also a module's)."""
    import importlib

    package = "models.evaluation"
    mod = importlib.import_module(package)
    assert sorted(mod.__all__) == sorted(mod._PUBLIC)
    for name, where in mod._PUBLIC.items():
        defining = importlib.import_module(f"{package}.{where}")
        assert getattr(mod, name) is getattr(defining, name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mod.nope  # noqa: B018


#: tests/service/ mirrors service/: a process package's tests in its folder, the whole process
#: tree (``vge serve`` started by the tests) in system/, the CLI's in cli/.
TEST_LAYERS = ("common", "engine", "frontend")


def test_service_tests_mirror_the_process_packages() -> None:
    """Every service test lives in tests/service/{common,engine,frontend,system,cli}/. A test in a
    layer's folder imports that layer (its subject) and starts no ``vge serve`` tree: those are
    system tests. Helpers (conftest.py) stay at tests/service/."""
    root = REPO / "tests" / "service"
    loose = sorted(p.name for p in root.glob("test_*.py"))
    assert not loose, f"tests/service/ holds test files outside a layer folder: {loose}"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == sorted((*TEST_LAYERS, "system", "cli")), folders
    wrong = []
    for layer in TEST_LAYERS:
        for path in sorted((root / layer).glob("test_*.py")):
            tree = ast.parse(path.read_text())
            imported = {
                node.module
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module
            } | {
                alias.name
                for node in ast.walk(tree)
                if isinstance(node, ast.Import)
                for alias in node.names
            }
            rel = path.relative_to(REPO)
            if not any(
                m == f"service.{layer}" or m.startswith(f"service.{layer}.") for m in imported
            ):
                wrong.append(f"{rel} does not import service.{layer}")
            if "start_server" in path.read_text():
                wrong.append(f"{rel} starts a vge serve tree: move it to tests/service/system/")
    assert not wrong, "\n".join(wrong)
