"""``celery redlock doctor`` on the nodes of the restart-without-persistence hazard."""

from __future__ import annotations

import json
import sys

from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner

import tests.apps
from tests.apps.cli_app import CONF_ENV
from tests.harness import APP_URL_ENV

APP_MODULE = "tests.apps.cli_app"


def test_doctor_flags_a_node_restarted_without_persistence(lab, monkeypatch):
    """No AOF, and a node restarted just now: an error and a delayed-restart warning."""
    servers = lab.servers(3)
    servers[1].kill()
    servers[1].start()  # at once, empty: the case that can grant a lock twice
    urls = [s.url for s in servers]
    monkeypatch.setenv(APP_URL_ENV, urls[0])
    monkeypatch.setenv(CONF_ENV, json.dumps({"redlock_nodes": urls, "redlock_ttl": 30}))
    monkeypatch.delitem(sys.modules, APP_MODULE, raising=False)
    monkeypatch.delattr(tests.apps, "cli_app", raising=False)
    try:
        result = CliRunner().invoke(
            celery_cli, ["-A", APP_MODULE, "redlock", "doctor", "--json"], catch_exceptions=False
        )
    finally:
        if APP_MODULE in sys.modules:
            sys.modules[APP_MODULE].app.close()
    assert result.exit_code == 1, result.output
    findings = {(f["node"], f["code"]): f for f in json.loads(result.stdout)["findings"]}
    restarted = urls[1]
    assert findings[(restarted, "persistence-off")]["level"] == "error"
    warning = findings[(restarted, "recent-restart")]
    assert warning["level"] == "warn"
    assert "30" in warning["message"], warning["message"]
