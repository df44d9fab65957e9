"""The package's layers: a module never imports a module of a higher layer.

From the bottom: shared basics; the nodes (how to talk to Redis masters); the lock
engine; the Celery integration; operations (CLI, doctor). ``docs/design.md`` draws
them. Every import counts, including those inside functions and under
``TYPE_CHECKING``: a lazy import is still a dependency (and was the package's one
import cycle, nodes <-> cluster).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "celery_redlock"

#: Lowest first. A module may import its own layer and the ones before it.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"exceptions", "metrics", "threads"}),
    ("nodes", {"nodes", "cluster"}),
    ("engine", {"keys", "timing", "scripts", "renewal", "waiting", "lock"}),
    ("integration", {"settings", "task", "worker", "beat", "config_only", "abort", "reaper"}),
    ("ops", {"cli", "doctor", "shares"}),
]
LAYER_OF = {module: rank for rank, (_, modules) in enumerate(LAYERS) for module in modules}


def _module_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in relative.parts if p != "__init__"]
    return parts[0] if parts else ""  # "" is the package itself: it may import anything


def _imports(path: Path) -> set[str]:
    """The package's top-level modules ``path`` imports (relative or absolute)."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for celery_redlock/x.py
    return _imported(path.read_text("utf-8"), depth)


def _imported(source: str, depth: int) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 < depth:
                    continue  # within a subpackage (scripts/...)
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
            elif node.module and node.module.split(".")[0] == "celery_redlock":
                rest = node.module.split(".")[1:]
                found.update(rest[:1] or [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "celery_redlock" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_module_has_a_layer():
    """A new module must be placed in a layer (and docs/design.md) before it lands."""
    modules = {_module_of(p) for p in PACKAGE.rglob("*.py")} - {""}
    assert modules - set(LAYER_OF) == set(), "add these modules to LAYERS and docs/design.md"


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_no_module_imports_a_higher_layer(path):
    """Lower layers know nothing of higher ones: the engine runs without Celery."""
    module = _module_of(path)
    if not module:
        return
    rank = LAYER_OF[module]
    higher = sorted(
        f"{imported} ({LAYERS[LAYER_OF[imported]][0]})"
        for imported in _imports(path)
        if imported in LAYER_OF and LAYER_OF[imported] > rank
    )
    assert not higher, f"{module} ({LAYERS[rank][0]}) imports a higher layer: {higher}"


def test_the_checker_sees_every_form_of_import():
    """Lazy, relative, absolute and TYPE_CHECKING imports all count (the old cycle was lazy)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import metrics\n"
        "import celery_redlock.beat\n"
        "from celery_redlock.doctor import run\n"
        "if TYPE_CHECKING:\n"
        "    from .settings import Settings\n"
        "def f():\n"
        "    from .cluster import ClusterNode\n"
    )
    assert _imported(source, 0) == {"metrics", "beat", "doctor", "settings", "cluster"}
    # Inside a subpackage, ``from . import x`` is a sibling there, ``..`` the package.
    assert _imported("from . import a\nfrom ..keys import K\n", 1) == {"keys"}
