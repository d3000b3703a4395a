"""The shape of the code: no import cycles among the app's own modules.

Every module of the packages below is parsed with ``ast`` (nothing is imported). An edge
``a -> b`` means that running ``a`` can import ``b``: an ``import`` or ``from ... import``
anywhere in ``a``, at module level or inside a function, resolved against the module's package
(``from . import x``, ``from .m import y``) and to the submodule when the imported name is one
(``from fedfm_flower.data import splits`` is an edge to ``fedfm_flower.data.splits``). Imports
under ``if TYPE_CHECKING:`` count too: they never run, but a module that names another's type
depends on it, and a cycle through them is a layer that knows one above it. Left out are the
implicit imports of parent packages (``import a.b.c`` runs ``a/__init__`` first), which every
submodule has, and imports of modules that do not exist.

Imports made by name at run time are edges too (``on_demand_imports``): a package's lazy exports
(``_EXPORTS`` of ``fedfm_flower.lazy``) from the package to each exporting module, the
``"module:name"`` paths of the method and model-family registries from the module that imports
them (``RESOLVERS``) to the module they name, and the method registry's discovery
(``DISCOVERERS``: ``pkgutil.iter_modules`` over a package) to every module of that package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedfm_flower", "strategies", "client_apps", "server_apps")


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``packages``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement (at any depth, under ``if TYPE_CHECKING:`` too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` (source ``path``) imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself.
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                for alias in node.names
            ]
        found.update(target for target in targets if target in modules and target != module)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports (only those of ``modules``)."""
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def lazy_exports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules a package's ``_EXPORTS`` (name -> module) import on first use."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            assert isinstance(node.value, ast.Dict), f"{module}._EXPORTS is not a dict literal"
            found |= {v.value for v in node.value.values if isinstance(v, ast.Constant)}
    return found & set(modules)


def _registry_paths() -> dict[str, set[str]]:
    """Resolver module -> the modules named by the ``"module:name"`` paths it imports."""
    from fedfm_flower.models.families import FAMILIES
    from fedfm_flower.registry import METHODS

    def modules_of(paths: list[str]) -> set[str]:
        return {p.partition(":")[0] for p in paths if p}

    return {
        RESOLVERS["methods"]: modules_of(
            [p for s in METHODS.values() for p in (s.strategy, s.client)]
        ),
        RESOLVERS["families"]: modules_of(
            [p for f in FAMILIES.values() for p in (f.builder, f.foundation)]
        ),
    }


# The modules that import the registries' "module:name" paths with importlib.
RESOLVERS = {"methods": "fedfm_flower.halves", "families": "fedfm_flower.models.build"}


# The modules that import every module of a package by discovery -> that package.
DISCOVERERS = {"fedfm_flower.registry": "fedfm_flower.methods"}


def on_demand_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports by name at run time (lazy exports, registry paths,
    discovery)."""
    edges = {name: lazy_exports(name, path, modules) for name, path in modules.items()}
    for resolver, targets in _registry_paths().items():
        assert "importlib.import_module" in modules[resolver].read_text(), resolver
        missing = targets - set(modules)
        assert not missing, f"registry paths name modules that do not exist: {missing}"
        edges[resolver] |= targets
    for discoverer, package in DISCOVERERS.items():
        assert "pkgutil.iter_modules" in modules[discoverer].read_text(), discoverer
        edges[discoverer] |= {name for name in modules if name.startswith(f"{package}.")}
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, each sorted (Tarjan's
    algorithm, iterative): the modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (``[a, b, ..., a]``) per strongly connected component."""
    return [_cycle_in(graph, set(component)) for component in strongly_connected(graph)]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected ``component``."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start] * 2
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_cycle_finder_reports_the_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved(tmp_path: Path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.sub import leaf\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "leaf.py").write_text(  # pkg.gone: a module that does not exist
        "from typing import TYPE_CHECKING\n"
        "from .. import top\n"
        "if TYPE_CHECKING:\n"
        "    from pkg import hidden\n"
        "def f():\n"
        "    from . import other\n"
        "    import pkg.gone\n"
    )
    for name in ("top", "hidden"):
        (package / f"{name}.py").write_text("")
    (package / "sub" / "other.py").write_text("from .leaf import f\nfrom pkg.sub import *\n")
    modules = module_files(tmp_path, ("pkg",))
    graph = import_graph(modules)
    assert graph["pkg"] == {"pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {"pkg.top", "pkg.hidden", "pkg.sub.other"}  # type-only too
    assert graph["pkg.sub.other"] == {"pkg.sub.leaf", "pkg.sub"}
    assert find_cycles(graph) == [["pkg.sub.leaf", "pkg.sub.other", "pkg.sub.leaf"]]


def test_on_demand_imports_are_found():
    edges = on_demand_imports(module_files())
    assert "fedfm_flower.models.build" in edges["fedfm_flower.models"]
    assert "strategies.fedavg" in edges[RESOLVERS["methods"]]
    assert "client_apps.fedprox" in edges[RESOLVERS["methods"]]
    assert "fedfm_flower.models.foundation" in edges[RESOLVERS["families"]]
    assert "fedfm_flower.methods.fedprox" in edges["fedfm_flower.registry"]  # discovered


def test_the_discovery_edge_closes_a_cycle_the_static_imports_miss():
    """A method module importing something that imports the registry is a cycle only through
    the registry's discovery: the test's graph must see it."""
    graph = {
        "fedfm_flower.registry": {"fedfm_flower.methods"},
        "fedfm_flower.methods": set(),
        "fedfm_flower.methods.fedprox": {"fedfm_flower.search"},
        "fedfm_flower.search": {"fedfm_flower.config"},
        "fedfm_flower.config": {"fedfm_flower.registry"},
    }
    assert find_cycles(graph) == []
    graph["fedfm_flower.registry"] |= {"fedfm_flower.methods.fedprox"}  # discovery
    assert find_cycles(graph) == [
        [
            "fedfm_flower.config",
            "fedfm_flower.registry",
            "fedfm_flower.methods.fedprox",
            "fedfm_flower.search",
            "fedfm_flower.config",
        ]
    ]


def test_no_import_cycles():
    modules = module_files()
    assert "fedfm_flower.data.source" in modules and "strategies.base" in modules
    graph = import_graph(modules)
    for module, targets in on_demand_imports(modules).items():
        graph[module] |= targets
    found = []
    for component in strongly_connected(graph):
        cycle = _cycle_in(graph, set(component))
        others = sorted(set(component) - set(cycle))
        also = f" (and with it: {', '.join(others)})" if others else ""
        found.append(" -> ".join(cycle) + also)
    assert not found, "import cycle(s):\n" + "\n".join(found)


def test_every_method_is_one_unit():
    """A method is its module in ``fedfm_flower/methods/`` (no torch, no Flower), halves that
    resolve to a strategy and a client logic class, and a ``configs/<method>/`` folder."""
    from client_apps.base import ClientLogic
    from fedfm_flower import registry
    from fedfm_flower.halves import client_class, strategy_class
    from strategies.base import PersonalizedStrategy

    modules = module_files()
    light = {"fedfm_flower.methods", "fedfm_flower.settings", "fedfm_flower.ranges"}
    for leaf in ("fedfm_flower.ranges", "fedfm_flower.search"):
        text = modules[leaf].read_text()
        assert "import torch" not in text and "import flwr" not in text, leaf
    assert imports_of("fedfm_flower.ranges", modules["fedfm_flower.ranges"], modules) == set()
    for name, path in modules.items():
        if name.startswith("fedfm_flower.methods."):
            assert imports_of(name, path, modules) <= light, name
            text = path.read_text()
            assert "import torch" not in text and "flwr" not in text, name
    for method in registry.METHODS:
        assert issubclass(strategy_class(method), PersonalizedStrategy), method
        assert issubclass(client_class(method), ClientLogic), method
        assert sorted((ROOT / "configs" / method).glob("*.toml")), f"configs/{method}/ is empty"
