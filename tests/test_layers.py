"""The package's layers, read from the code's own imports (``ast``): no import cycle, no upward import.

Every import counts: at module level, inside a function, under ``TYPE_CHECKING``. The layers, lowest first, are
DESIGN.md's; each subpackage's docstring says what it may import. ``launch/`` is the runnable programs: the library
never imports it, and it has no cycle of its own either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module (or package prefix) -> rank; a module may import only ranks below its own, or its own package.
LAYERS: list[tuple[str, int]] = [
    ("dist_optim._torch_internals", 0),
    ("dist_optim.engine", 1),
    ("dist_optim.parallel", 2),
    ("dist_optim", 3),  # the facade: optimizer.py and its helpers, pipeline.py, averaging.py
    ("dist_optim.checkpoint", 4),
    ("dist_optim.integrations", 4),
    ("dist_optim._planner", 5),
    ("dist_optim.plan", 6),  # `python -m dist_optim.plan`
    ("dist_optim.__init__", 7),  # the public surface re-exports every layer
    ("launch", 8),
]
MAX_TOP_MODULES = 10
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1]) + ".__init__" if parts[-1] == "__init__" else ".".join(parts)


def _package(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _imports(path: Path, name: str) -> set[str]:
    """The project modules ``path`` imports, anywhere in it; ``from pkg import mod`` counts as ``pkg.mod``."""
    tree = ast.parse(path.read_text(), str(path))
    modules = set(_MODULES)
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name).split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules or f"{mod}.{a.name}.__init__" in modules
                       else mod for a in node.names]
        for t in targets:
            if t.split(".")[0] not in ("dist_optim", "launch"):
                continue
            t = t if t in modules else f"{t}.__init__"
            if t != name and t in modules:
                found.add(t)
    return found


def _all_modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("dist_optim").rglob("*.py"), *ROOT.joinpath("launch").glob("*.py")]
    return {_module_name(f): f for f in files}


_MODULES = _all_modules()


def _rank(name: str) -> int:
    best = max((p for p, _ in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def _layer(name: str) -> str:
    return max((p for p, _ in LAYERS if name == p or name.startswith(p + ".")), key=len)


def _graph() -> dict[str, set[str]]:
    return {name: _imports(path, name) for name, path in _MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_no_upward_import():
    upward = [f"{a} imports {b}" for a, targets in _graph().items() for b in sorted(targets)
              if _layer(a) != _layer(b) and _rank(b) >= _rank(a)]
    assert upward == []


def test_the_library_never_imports_the_planner_or_launch():
    below = [name for name in _MODULES if _rank(name) < _rank("dist_optim._planner")]
    bad = [f"{a} imports {b}" for a in below for b in sorted(_imports(_MODULES[a], a))
           if b.startswith(("dist_optim._planner", "launch"))]
    assert bad == []


def test_the_top_of_the_package_shows_its_layers():
    top = sorted(p.name for p in ROOT.joinpath("dist_optim").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    for package in ("engine", "parallel", "_planner", "checkpoint", "integrations"):
        doc = ast.get_docstring(ast.parse(ROOT.joinpath("dist_optim", package, "__init__.py").read_text()))
        assert doc, f"dist_optim/{package}/__init__.py says what the layer is for"


def test_no_file_over_the_size_guide():
    long = {str(p.relative_to(ROOT)): n for p in _MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize(("source", "bad"), [
    ("from dist_optim.optimizer import InBackwardOptimizer\n", "dist_optim.engine._engine imports dist_optim.optimizer"),
    ("def f():\n    from dist_optim import _training_step\n", "dist_optim.engine._engine imports dist_optim._training_step"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dist_optim.parallel._ddp\n",
     "dist_optim.engine._engine imports dist_optim.parallel._ddp"),
])
def test_the_check_sees_an_upward_import_wherever_it_is_written(tmp_path, source, bad):
    path = tmp_path / "_engine.py"
    path.write_text(source)
    name = "dist_optim.engine._engine"
    found = [f"{name} imports {b}" for b in _imports(path, name) if _layer(b) != _layer(name) and _rank(b) >= _rank(name)]
    assert found == [bad]


def test_the_check_sees_a_cycle():
    graph = _graph()
    graph["dist_optim.engine._link"] = graph["dist_optim.engine._link"] | {"dist_optim.engine._engine"}
    assert ["dist_optim.engine._engine", "dist_optim.engine._link"] in _cycles(graph)
