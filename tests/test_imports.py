"""Imports inside the package go one way: no module imports, directly or through others, a module that imports it.

Every import statement counts, wherever it stands (at the top, inside a function, under `if TYPE_CHECKING:`): a
circle hidden in a function is still one for a reader. The graph is read from the source with ast, not by
importing, so a circle that happens to import cleanly is found too.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(package: str = "accumnorm") -> dict[str, Path]:
    """Dotted name -> file of every module under src/<package> (a package is its __init__.py)."""
    found = {}
    for path in sorted((SRC / package).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports, relative imports resolved.

    `from X import y` imports X.y where that is a module, else X itself.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {t for t in targets if t in known and t != name}


def import_graph(package: str = "accumnorm") -> dict[str, set[str]]:
    files = modules(package)
    return {name: imported(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, component) for component in components]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected component has a circle")


def test_the_graph_reads_relative_and_absolute_imports():
    graph = import_graph()
    assert "accumnorm._engine.backward" in graph["accumnorm"]  # from ._engine.backward import backward
    assert "accumnorm.distributed" in graph["accumnorm"]  # from . import distributed
    assert "accumnorm.layers" in graph["accumnorm.study._model"]  # from accumnorm.layers import ...
    assert "accumnorm.study._store" in graph["accumnorm.study._runner"]  # from . import _store as store


def test_cycles_finds_a_circle_and_prints_it_closed():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_module_of_the_study_imports_itself_back():
    """The study's registry of tasks at the bottom, the tasks above it, the runner on top."""
    graph = {name: deps for name, deps in import_graph().items() if name.startswith("accumnorm.study")}
    found = cycles({name: {d for d in deps if d in graph} for name, deps in graph.items()})
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


# The engine's layers, bottom to top: each may import from the layers below it and from its own, never from one above.
# The engine's own top-level modules (`backward`, `args`, `lazy_eps`) sit above them all.
ENGINE = "accumnorm._engine"
LAYERS = ["bn", "safety", "memory", "intercept", "checkpointing", "step", "schedules"]


def engine_layer(name: str) -> int:
    """The layer of an engine module: its index in LAYERS, or len(LAYERS) for the engine's top-level modules."""
    part = name[len(ENGINE) + 1:].partition(".")[0]
    return LAYERS.index(part) if part in LAYERS else len(LAYERS)


def test_the_engine_has_its_layers_as_packages_and_few_modules_at_its_top():
    engine = SRC / "accumnorm" / "_engine"
    packages = sorted(p.name for p in engine.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(LAYERS)
    assert len(list(engine.glob("*.py"))) <= 8
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((engine / layer / "__init__.py").read_text()))
        assert doc is not None and f"Layer `{layer}`" in doc, f"_engine/{layer}/__init__.py names its layer"


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it imports) for each import of an engine module from a layer above its own."""
    return [(name, dep) for name, deps in sorted(graph.items()) if name.startswith(ENGINE + ".")
            for dep in sorted(deps) if dep.startswith(ENGINE + ".") and engine_layer(dep) > engine_layer(name)]


def test_no_engine_module_imports_from_a_layer_above_its_own():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a layer above: " + "; ".join(f"{a} -> {b}" for a, b in upward)


def test_the_layer_check_finds_an_upward_import_and_passes_downward_ones():
    graph = {"accumnorm._engine.bn.whole": {"accumnorm._engine.step.meeting", "accumnorm.functional"},
             "accumnorm._engine.step.meeting": {"accumnorm._engine.bn.whole", "accumnorm._engine.step.ledger"},
             "accumnorm._engine.backward": {"accumnorm._engine.schedules.decide"}}
    assert upward_imports(graph) == [("accumnorm._engine.bn.whole", "accumnorm._engine.step.meeting")]
    assert engine_layer("accumnorm._engine.backward") == len(LAYERS)
