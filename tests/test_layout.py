"""The house's layout: no import circle among our modules (lanes/, deployments/, controller/, loadtest/),
deployments/ in one order of its packages, and no package past about fifteen modules.

Every import counts, those under TYPE_CHECKING and inside functions too: a circle hidden there is
still two modules that cannot be read, or changed, one without the other. Importing a module runs
its package's __init__, so a module depends on its package as well.
"""

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lanes", "deployments", "controller", "loadtest")
# deployments/, bottom to top: its packages and the modules at its top level, each importing only from
# those before it (the small shared config sits low, so the replicas and the ingress can read it).
DEPLOYMENTS_ORDER = ("routing", "placement", "config", "telemetry", "channels", "factories", "replicas", "api",
                     "planning", "builder", "app")
MAX_MODULES = 15  # a layer past about fifteen files splits into packages, one concept each (STYLE.md)


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



def _layer(module: str) -> str:
    """deployments.routing.leases -> routing; deployments.config -> config."""
    return module.split(".")[1]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports within deployments/ that reach a layer above their own in DEPLOYMENTS_ORDER."""
    rank = {layer: i for i, layer in enumerate(DEPLOYMENTS_ORDER)}
    return [f"{module} -> {dep}" for module, deps in graph.items() if module.startswith("deployments.")
            for dep in deps if dep.startswith("deployments.") and rank[_layer(dep)] > rank[_layer(module)]]


def test_deployments_import_in_order():
    graph = import_graph()
    layers = {_layer(module) for module in graph if module.startswith("deployments.")}
    assert layers == set(DEPLOYMENTS_ORDER), f"not both in deployments/ and in the order: {layers ^ set(DEPLOYMENTS_ORDER)}"
    assert not _upward(graph), _upward(graph)


def test_the_check_sees_an_upward_import():
    # The timelines (telemetry) importing the remote proxies (channels) would be an import upward.
    graph = import_graph()
    graph["deployments.telemetry.timeline"] = graph["deployments.telemetry.timeline"] | {"deployments.channels.remote"}
    assert _upward(graph) == ["deployments.telemetry.timeline -> deployments.channels.remote"]


def test_deployments_packages_stay_small():
    folders = [ROOT / "deployments", *(ROOT / "deployments" / layer for layer in DEPLOYMENTS_ORDER
                                       if (ROOT / "deployments" / layer).is_dir())]
    counts = {folder.name: len([p for p in folder.glob("*.py") if p.name != "__init__.py"]) for folder in folders}
    assert len(folders) > 1 and all(0 < n <= MAX_MODULES for n in counts.values()), counts
