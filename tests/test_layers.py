"""The package's layers: a module never imports a module of a higher layer.

From the bottom: the basics (``exceptions``, ``base/``); ``nodes/`` (how to talk to
Redis masters); ``engine/`` (the lock, with no knowledge of Celery); ``integration/``
(the Celery layer); ``ops/`` (the CLI and doctor); ``testing/`` (the pytest plugin).
The package root only re-exports: its ``__init__`` and the alias modules at public
paths users write (``celery_redlock.beat``). ``docs/design.md`` draws them. Every import
counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import is
still a dependency, and forms a cycle like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "celery_redlock"

#: Lowest first. A module may import its own layer and the ones before it. A layer is a
#: subpackage, or a top-level module (``exceptions``: the path users import it from).
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"exceptions", "base"}),
    ("nodes", {"nodes"}),
    ("engine", {"engine"}),
    # the Celery layer: settings and options, the task, its policies, worker and beat
    ("integration", {"integration"}),
    ("ops", {"ops"}),
    # the pytest plugin: servers and fixtures for projects' tests of their tasks
    ("testing", {"testing"}),
]
#: ``celery_redlock`` itself (its ``__init__``) imports the Celery layer.
ROOT_RANK = [name for name, _ in LAYERS].index("integration")
#: Top-level modules that only re-export names at a path users write in configuration
#: (``-S celery_redlock.beat:LeaderScheduler``). They rank with the package root, and no
#: module of the package imports them: the package uses the real paths.
ALIASES = {"beat"}
LAYER_OF = {unit: rank for rank, (_, units) in enumerate(LAYERS) for unit in units}
LAYER_OF.update(dict.fromkeys(ALIASES, ROOT_RANK))

#: Within a layer, modules that only the named ones may import: the node factory
#: registry is how ``nodes`` reaches the cluster node without importing it.
PRIVATE_TO = {
    "celery_redlock.nodes.cluster": {"celery_redlock.engine.lock"},
}


def _dotted(path: Path) -> tuple[str, bool]:
    """``path``'s module name and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of what ``source`` (the text of ``module``) imports from the package."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "celery_redlock":
                base = []
            else:
                continue
            target = [*base, *(node.module.split(".") if node.module else [])]
            found.update(".".join([*target, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                alias.name for alias in node.names if alias.name.split(".")[0] == "celery_redlock"
            )
    return found


def _rank(name: str) -> int:
    parts = name.split(".")
    return LAYER_OF.get(parts[1], ROOT_RANK) if len(parts) > 1 else ROOT_RANK


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    """A new module or subpackage must be placed in a layer (and docs/design.md)."""
    units = {_dotted(p)[0].split(".")[1] for p in _sources() if _dotted(p)[0] != "celery_redlock"}
    assert units - set(LAYER_OF) == set(), "add these to LAYERS and docs/design.md"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    """Lower layers know nothing of higher ones: the engine runs without Celery."""
    module, is_package = _dotted(path)
    if module == "celery_redlock":
        return
    rank = _rank(module)
    imported = _imported(path.read_text("utf-8"), module, is_package)
    higher = sorted(f"{name} ({LAYERS[_rank(name)][0]})" for name in imported if _rank(name) > rank)
    assert not higher, f"{module} ({LAYERS[rank][0]}) imports a higher layer: {higher}"
    for name in imported:
        for private, allowed in PRIVATE_TO.items():
            if (name == private or name.startswith(private + ".")) and module != private:
                assert module in allowed, f"{module} imports {private}, which only {allowed} may"


def test_no_module_of_the_package_imports_an_alias():
    """Alias modules are for users' configuration strings; the package imports the code."""
    aliases = {f"celery_redlock.{alias}" for alias in ALIASES}
    for path in _sources():
        module, is_package = _dotted(path)
        imported = _imported(path.read_text("utf-8"), module, is_package)
        through = sorted(
            name for name in imported for a in aliases if name == a or name.startswith(a + ".")
        )
        assert not through, f"{module} imports an alias: {through} (import the real module)"


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_module_only_re_exports(alias):
    """A docstring, imports from the package, ``__all__`` and at most a ``__getattr__``
    that forwards: nothing an alias holds can drift from the code it names."""
    tree = ast.parse((PACKAGE / f"{alias}.py").read_text("utf-8"))
    assert ast.get_docstring(tree)
    for node in tree.body[1:]:
        if isinstance(node, ast.ImportFrom):
            assert node.level == 1 or node.module == "typing", ast.unparse(node)
        elif isinstance(node, ast.Assign):
            assert [ast.unparse(t) for t in node.targets] == ["__all__"], ast.unparse(node)
        else:
            assert isinstance(node, ast.FunctionDef) and node.name == "__getattr__", ast.unparse(
                node
            )
            assert len(node.body) == 2, "a docstring and one return"


def test_the_checker_sees_every_form_of_import():
    """Lazy, relative, absolute and TYPE_CHECKING imports all count (the old cycle was lazy)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .. import metrics\n"
        "import celery_redlock.beat\n"
        "from celery_redlock.ops.doctor import run\n"
        "if TYPE_CHECKING:\n"
        "    from ..settings import Settings\n"
        "def f():\n"
        "    from .cluster import ClusterNode\n"
    )
    assert _imported(source, "celery_redlock.nodes.calls") == {
        "celery_redlock.metrics",
        "celery_redlock.beat",
        "celery_redlock.ops.doctor.run",
        "celery_redlock.settings.Settings",
        "celery_redlock.nodes.cluster.ClusterNode",
    }
    # In a package's __init__, ``from . import x`` is that package's x.
    assert _imported("from . import a\n", "celery_redlock.engine", is_package=True) == {
        "celery_redlock.engine.a"
    }
    assert _rank("celery_redlock.engine.keys.K") < _rank("celery_redlock.integration.task")
    assert _rank("celery_redlock.base.poll") < _rank("celery_redlock.nodes.node")
    assert _rank("celery_redlock.Redlock") == ROOT_RANK  # the package root: integration


def test_a_violation_is_reported():
    """The engine importing the Celery integration fails the check (it is not vacuous)."""
    imported = _imported(
        "from ..integration.task import LockedTask\n", "celery_redlock.engine.lock"
    )
    assert [_rank(name) > _rank("celery_redlock.engine.lock") for name in imported] == [True]


def _import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (any import)."""
    modules = {_dotted(path)[0]: path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
                if not node.level:
                    module = node.module or ""
                for alias in node.names:
                    member = f"{module}.{alias.name}"
                    found.add(member if member in modules else module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_even_under_type_checking():
    """No two modules import each other, directly or through others, by any import
    (under ``TYPE_CHECKING`` and inside functions too): the engine's lock, kinds and
    handoff were one cycle, options and settings another. The package's ``__init__``
    files are left out: a subpackage's re-exports are not its modules' dependencies."""
    graph = {
        name: {m for m in deps if not m.endswith("__init__")}
        for name, deps in _import_graph().items()
        if name != "celery_redlock"
    }
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    """The checker itself: a two-module cycle and a three-module one are reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": set()}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


#: The longest function the lock engine may have, in lines (docstring included): a
#: reader checks a safety argument one function at a time.
MAX_ENGINE_FUNCTION = 60


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    tree = ast.parse(source)
    return [
        (node.name, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit  # type: ignore[operator]
    ]


def test_no_engine_function_is_longer_than_the_limit():
    too_long = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted((PACKAGE / "engine").rglob("*.py"))
        if (found := _long_functions(path.read_text(), MAX_ENGINE_FUNCTION))
    }
    assert not too_long


def test_the_length_check_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_ENGINE_FUNCTION))
    assert _long_functions(f"def f():\n{body}\n", MAX_ENGINE_FUNCTION) == [
        ("f", MAX_ENGINE_FUNCTION + 1)
    ]
