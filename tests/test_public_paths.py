"""Every import path users write keeps working, whatever the package's inner layout.

Users name ``celery_redlock.beat:LeaderScheduler`` in ``beat_scheduler`` and ``-S``,
load ``celery_redlock.testing`` as a pytest plugin, import from ``celery_redlock`` and
``celery_redlock.exceptions``, and Celery records an exception's module with a failed
task's result. The README and the manual name these paths; each one they name must
resolve.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from celery.beat import Scheduler
from celery.utils.imports import symbol_by_name

import celery_redlock

ROOT = Path(__file__).resolve().parents[1]
#: A dotted path of the package in prose or code, with an optional ``:attribute``.
#: A dotted path of the package; not a file name in a path (``grafana/celery_redlock.json``).
DOTTED = re.compile(r"(?<![\w/.-])celery_redlock(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")

#: The documented names of each public module (docs/reference/*.md).
PUBLIC = {
    "celery_redlock.beat": ["LeaderScheduler", "LeaderMixin", "parse_beat_holder"],
    "celery_redlock.exceptions": [
        "RedlockError",
        "LockBusy",
        "LockLost",
        "LockNotOwned",
        "NodeUnavailable",
        "LockKeyError",
        "ConfigurationError",
    ],
    "celery_redlock.testing": [
        "hold_task_lock",
        "use_redlock_url",
        "redlock_server",
        "redlock_url",
        "redlock_app",
        "redlock_celery_app",
    ],
}


def resolve(path: str) -> object:
    """What ``path`` names: ``module:attribute``, a module, or a module's attribute."""
    if ":" in path:
        return symbol_by_name(path)
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(path)


def documented_paths() -> list[str]:
    """Every dotted path of the package that README.md and docs/ name (not the changelog)."""
    pages = [ROOT / "README.md"] + [
        page for page in sorted((ROOT / "docs").rglob("*.md")) if page.name != "changelog.md"
    ]
    return sorted({match for page in pages for match in DOTTED.findall(page.read_text())})


def test_every_name_in_all_is_importable_from_the_package():
    for name in celery_redlock.__all__:
        assert getattr(celery_redlock, name) is not None, name


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_module_has_its_documented_names(module):
    imported = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert getattr(imported, name) is not None, f"{module}.{name}"


def test_the_beat_scheduler_path_resolves_as_celery_resolves_it():
    """``-S celery_redlock.beat:LeaderScheduler``: Celery's own lookup finds a scheduler."""
    scheduler = symbol_by_name("celery_redlock.beat:LeaderScheduler")
    assert isinstance(scheduler, type) and issubclass(scheduler, Scheduler)
    assert scheduler is celery_redlock.beat.LeaderScheduler


def test_the_database_scheduler_path_resolves_in_a_django_project():
    """``celery_redlock.beat:DatabaseLeaderScheduler``, made when first named."""
    pytest.importorskip("django_celery_beat", reason="django-celery-beat: in the 'test' extra")
    probe = (
        "import django; django.setup(); "
        "from celery.utils.imports import symbol_by_name; "
        "from django_celery_beat.schedulers import DatabaseScheduler; "
        "s = symbol_by_name('celery_redlock.beat:DatabaseLeaderScheduler'); "
        "assert issubclass(s, DatabaseScheduler), s; "
        "assert s is symbol_by_name('celery_redlock.beat:DatabaseLeaderScheduler'); "
        "print('ok')"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.apps.djangoproj.settings"}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_exceptions_keep_the_module_celery_records():
    """A failed task's result names its exception's module; old results must still load."""
    for name in PUBLIC["celery_redlock.exceptions"]:
        assert getattr(celery_redlock, name).__module__ == "celery_redlock.exceptions", name


def test_the_entry_points_resolve():
    """The pytest plugin and the ``celery redlock`` command, as pip installed them."""
    plugins = {ep.name: ep for ep in entry_points(group="pytest11")}
    assert plugins["celery_redlock.testing"].load() is importlib.import_module(
        "celery_redlock.testing"
    )
    commands = {ep.name: ep for ep in entry_points(group="celery.commands")}
    assert commands["redlock"].load() is symbol_by_name("celery_redlock.ops.cli:redlock")


def test_the_docs_name_paths():
    """The check below is not vacuous: the manual names the paths users write."""
    assert {
        "celery_redlock.beat:LeaderScheduler",
        "celery_redlock.testing",
        "celery_redlock.exceptions",
    } <= set(documented_paths())


# DatabaseLeaderScheduler needs a configured Django project: checked above.
@pytest.mark.parametrize(
    "path", [p for p in documented_paths() if not p.endswith(":DatabaseLeaderScheduler")]
)
def test_every_path_the_docs_name_resolves(path):
    assert resolve(path) is not None
