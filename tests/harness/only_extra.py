"""Run pytest as if only one extra of the project were installed (``test-core``).

``python tests/harness/only_extra.py PYPROJECT EXTRA [pytest args]``: every module of a
distribution that the full ``test`` extra brings and ``EXTRA`` does not is made
unimportable, so that what a packager sees after ``pip install '.[test-core]'`` is
seen here, in a virtualenv that has everything. Run by path, not as a module of
``tests.harness`` (whose imports would come first).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Any

import tomllib

FULL = "test"
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?")


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_distributions(pyproject: Path, extra: str) -> set[str]:
    """The distributions an extra of the project installs, its own extras expanded."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras, own = project["optional-dependencies"], normalized(project["name"])
    found: set[str] = set()
    seen: set[str] = set()
    todo = [extra]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in extras[name]:
            match = _REQUIREMENT.match(requirement)
            assert match, requirement
            if normalized(match.group(1)) == own:
                todo += [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
            else:
                found.add(normalized(match.group(1)))
    return found


def missing_modules(pyproject: Path, extra: str) -> list[str]:
    """Top-level modules of the distributions that ``test`` has and ``extra`` lacks."""
    lacking = extra_distributions(pyproject, FULL) - extra_distributions(pyproject, extra)
    return sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not module.startswith("_") and {normalized(d) for d in dists} & lacking
    )


class Missing(importlib.abc.MetaPathFinder):
    """Makes ``import`` of the named top-level modules fail as if they were not installed."""

    def __init__(self, modules: list[str], extra: str) -> None:
        self.modules = set(modules)
        self.extra = extra

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] in self.modules:
            raise ModuleNotFoundError(
                f"No module named {name!r} (not in [{self.extra}])", name=name
            )


def main(argv: list[str]) -> int:
    pyproject, extra, *args = argv
    modules = missing_modules(Path(pyproject), extra)
    print(f"modules missing with [{extra}]: {' '.join(modules)}", file=sys.stderr)
    for module in modules:
        sys.modules.pop(module, None)
    sys.meta_path.insert(0, Missing(modules, extra))
    import pytest

    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
