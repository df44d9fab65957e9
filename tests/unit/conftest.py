"""Fixtures of the unit tests: ``cli`` runs ``celery -A <app> redlock ...`` (the ops and
node tests use it) through Celery's own CLI group, against real servers.

The CLI loads ``tests.apps.cli_app``, which builds its app from the environment at
import; the ``cli`` fixture points it at the test's servers and drops the module from
``sys.modules`` first, so every invocation builds the app again.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner, Result

import tests.apps
from tests.apps.cli_app import CONF_ENV
from tests.harness import APP_URL_ENV

APP_MODULE = "tests.apps.cli_app"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Result]]:
    """``cli(url, *args, conf=None, input=None)``: run ``celery -A cli_app redlock *args``."""
    apps = []

    def run(url: str, *args: str, conf: dict | None = None, input: Any = None) -> Result:
        monkeypatch.setenv(APP_URL_ENV, url)
        monkeypatch.setenv(CONF_ENV, json.dumps(conf or {}))
        # Celery's find_app looks the module up as an attribute of its package first.
        monkeypatch.delitem(sys.modules, APP_MODULE, raising=False)
        monkeypatch.delattr(tests.apps, "cli_app", raising=False)
        try:
            return CliRunner().invoke(
                celery_cli,
                ["-A", APP_MODULE, "redlock", *args],
                input=input,
                catch_exceptions=False,
            )
        finally:
            module = sys.modules.get(APP_MODULE)
            if module is not None:
                apps.append(module.app)

    yield run
    for app in apps:
        app.close()
