"""The house's layout: no import circle among our modules (lanes/, deployments/, controller/, loadtest/).

Every import counts, those under TYPE_CHECKING and inside functions too: a circle hidden there is
still two modules that cannot be read, or changed, one without the other. Importing a module runs
its package's __init__, so a module depends on its package as well.
"""

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lanes", "deployments", "controller", "loadtest")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path, tree: ast.AST) -> list[str]:
    """Dotted names this module imports: modules, and module.name for `from m import name`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + ([base] if base else []))
            out += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules (ours) it imports, with the packages whose __init__ that runs."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for target in _imported(name, path, ast.parse(path.read_text())):
            while target and target not in modules:
                target = target.rpartition(".")[0]  # module.name -> module
            while target:
                deps.add(target)
                target = target.rpartition(".")[0]  # importing a.b.c runs a and a.b first
        graph[name] = deps - {name} - {p for p in _parents(name)}
    return graph


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_no_import_circle():
    graph = import_graph()
    assert "lanes.engine.core" in graph and "deployments.app" in graph, sorted(graph)
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def test_the_check_sees_a_circle():
    # The same check over a graph with a circle, hidden behind a TYPE_CHECKING import, must fail.
    graph = import_graph()
    graph["lanes.sample.params"] = graph["lanes.sample.params"] | {"lanes.sample.grammar"}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        return
    raise AssertionError("a circle through lanes.sample.params went unseen")

