"""``celery redlock`` on the Celery versions pyproject admits (celery>=5.3).

Celery 5.3 to 5.5 lack ``celery.bin.base.handle_remote_command_error`` (added in 5.6).
The test removes it before the CLI module is imported, in a fresh interpreter, as
those versions are; the CI matrix runs the whole suite on each version.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.harness import free_port

PRETEND_CELERY_55 = """
import celery.bin.base
if hasattr(celery.bin.base, "handle_remote_command_error"):
    del celery.bin.base.handle_remote_command_error
"""


pytestmark = pytest.mark.smoke


def test_cli_loads_and_reports_a_dead_broker_without_celery_5_6():
    """Without handle_remote_command_error the command loads, and a broker that cannot be
    reached is still an EX_UNAVAILABLE error naming the broker."""
    port = free_port()
    code = PRETEND_CELERY_55 + textwrap.dedent(
        f"""
        from celery import Celery
        from celery.exceptions import CeleryCommandException
        from celery_redlock.ops.cli import redlock
        from celery_redlock.ops.workers import ask_workers

        commands = {{"ls", "inspect", "release", "doctor", "why", "log", "web"}}
        assert set(redlock.commands) == commands
        app = Celery("compat", broker="redis://127.0.0.1:{port}/1", set_as_current=False)
        app.conf.broker_connection_retry = False
        app.conf.broker_connection_max_retries = 0
        try:
            ask_workers(app, 0.2)
        except CeleryCommandException as exc:
            print("exit", exc.exit_code, exc.message)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("exit 69 Could not connect to the message broker"), proc.stdout
